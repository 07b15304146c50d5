"""The serving benchmark refuses to label quantmla's cache as vLLM's own: a ``*-vllm`` scheme on a model
directory whose ``quantmla.json`` switches the plugin on is one clear error (a run on the H200 measured C4R4
as ``bf16-vllm`` that way before the check existed)."""

from functools import partial
from pathlib import Path

import pytest

from script_modules import load_script

_module = partial(load_script, "benchmarks/serving_pressure.py")


def test_vllm_schemes_refuse_a_directory_that_switches_the_plugin_on(tmp_path):
    sp = _module()
    model = sp.dummy_model_dir(tmp_path)
    sp.check_model_dir(model, ["bf16-vllm", "c4r4"])  # no quantmla.json: fine
    (Path(model) / "quantmla.json").write_text("{}")
    sp.check_model_dir(model, ["c4r4", "c2r4"])  # quantmla's own schemes: the file is theirs to agree with
    with pytest.raises(SystemExit, match="bf16-vllm would not run vLLM's own cache"):
        sp.check_model_dir(model, ["c4r4", "bf16-vllm"])


def test_workloads_parse():
    assert _module().parse_workloads("5x32768+1024,6x12288+2048") == [(5, 32768, 1024), (6, 12288, 2048)]
