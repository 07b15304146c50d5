from typer.testing import CliRunner

from quantmla.cli.main import app

runner = CliRunner()


def test_demo_small():
    res = runner.invoke(
        app,
        ["demo", "--prompt-len", "40", "--new-tokens", "4", "--recent", "8", "--schemes", "bf16,c4r4", "--batch", "1"],
        terminal_width=200,
    )
    assert res.exit_code == 0, res.output
    assert "c4r4" in res.output and "bf16" in res.output
    assert "324.0" in res.output or "324." in res.output  # C4R4 at 128K: 324 B/token + windows


def test_demo_bad_scheme_is_a_clear_error():
    res = runner.invoke(app, ["demo", "--schemes", "bf16,int3"], terminal_width=200)
    assert res.exit_code != 0
    assert "unknown cache scheme 'int3'" in res.output


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("quantmla ")
