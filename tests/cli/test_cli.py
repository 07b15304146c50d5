import json

from typer.testing import CliRunner

from quantmla.cli.main import app

runner = CliRunner()


def test_demo_small():
    res = runner.invoke(
        app,
        [
            "demo",
            "--num-seqs",
            "1",
            "--seq-len",
            "160",
            "--new-tokens",
            "4",
            "--schemes",
            "bf16,c4r4",
            "--calibrate-steps",
            "2",
            "--calibrate-model-steps",
            "1",
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, res.output
    assert "Perplexity on the bundled test split" in res.output
    assert "324.8" in res.output  # C4R4 at 128K, DeepSeek geometry, measured from storage
    assert "c4r4+quantmla" in res.output  # the short calibration ran and was evaluated


def test_demo_bad_scheme_is_a_clear_error():
    res = runner.invoke(app, ["demo", "--schemes", "bf16,int3"], terminal_width=200)
    assert res.exit_code != 0
    assert "unknown cache scheme 'int3'" in res.output


def test_eval_ppl_json():
    res = runner.invoke(
        app, ["eval", "ppl", "--scheme", "bf16,c2r4", "--num-seqs", "1", "--seq-len", "200", "--recent", "16", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{") :])
    r = {x["scheme"]: x for x in out["results"]}
    assert r["bf16"]["tokens"] == 199 and r["c2r4"]["recent"] == 16
    assert 1 < r["bf16"]["ppl"] < 1000 and r["c2r4"]["ppl"] != r["bf16"]["ppl"]
    assert r["c2r4"]["bytes_per_token"] < r["bf16"]["bytes_per_token"]


def test_eval_ppl_errors():
    res = runner.invoke(app, ["eval", "ppl", "--scheme", "c9r4", "--num-seqs", "1"])
    assert res.exit_code != 0 and "unknown cache scheme 'c9r4'" in res.output
    res = runner.invoke(app, ["eval", "ppl", "--num-seqs", "100000"])
    assert res.exit_code != 0 and "num_seqs=100000" in res.output


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("quantmla ")
