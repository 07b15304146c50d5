"""The installed ``quantmla`` script logs quantmla's INFO lines on stderr, as ``python -m quantmla`` does."""

import subprocess
import sys
from importlib.metadata import entry_points


def test_the_console_script_shows_quantmla_info_lines(tmp_path):
    # the console script as pip writes it: import the entry point's object and call it
    (script,) = entry_points(group="console_scripts", name="quantmla")
    module, attr = script.value.split(":")
    code = f"import sys; from {module} import {attr}; sys.exit({attr}())"
    args = ["eval", "ppl", "builtin:tiny-mla", "--scheme", "bf16", "--num-seqs", "1", "--seq-len", "32"]
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "quantmla.models.loading: loading " in run.stderr and " in float32 on cpu" in run.stderr, run.stderr
