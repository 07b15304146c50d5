"""Every user mistake: one line naming the bad value and the valid ones, exit code 2, no traceback, and
nothing loaded before the check (from_pretrained is patched to fail the test if it is reached)."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from typer.testing import CliRunner

from quantmla.cli.main import app
from quantmla.models.loading import builtin_path

runner = CliRunner()


@pytest.fixture
def no_weights(monkeypatch):
    """Reaching from_pretrained (reading weights) fails the test."""

    def boom(*args, **kwargs):
        raise AssertionError("weights were loaded before the bad input was reported")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)


def _usage_error(args, *fragments, env=None):
    res = runner.invoke(app, args, env=env)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_cuda_device_without_cuda(no_weights, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cmd in (["eval", "ppl"], ["analyze"], ["calibrate", "--out", "x"]):
        _usage_error([*cmd, "--device", "cuda"], "device 'cuda'", "no CUDA device", "valid: cpu")
    _usage_error(["eval", "ppl", "--device", "tpu9"], "'tpu9'", "valid: cpu, cuda, cuda:N")


def test_dtype(no_weights):
    for cmd in (["eval", "ppl"], ["analyze"], ["calibrate", "--out", "x"], ["demo"]):
        _usage_error([*cmd, "--dtype", "float16"], "dtype 'float16'", "valid: auto, bfloat16, float32, float64")


def test_analyze_quantizer_fp8_is_rejected_without_recommending_it(no_weights):
    line = _usage_error(["analyze", "--quantizer", "fp8"], "quantizer='fp8'", "RoPE key unquantised", "c4r4")
    assert "fp8" not in line.split("valid:")[1]
    line = _usage_error(["analyze", "--quantizer", "bf16"], "quantizer='bf16'", "valid:")
    assert "fp8" not in line.split("valid:")[1]
    _usage_error(["analyze", "--quantizer", "c9r9"], "unknown cache scheme 'c9r9'", "valid: bf16")


@pytest.mark.parametrize(
    "layers,fragment",
    [("a", "'a' is not an integer"), ("0,x", "'x' is not an integer"), ("99", "[99] out of range"),
     ("-1", "[-1] out of range"), ("8", "[8] out of range"), (",", "names no layer")],
)  # fmt: skip
def test_analyze_layers(no_weights, layers, fragment):
    _usage_error(["analyze", f"--layers={layers}"], fragment, "valid: comma-separated cache indices in 0..7")


def test_analyze_shape(no_weights):
    _usage_error(["analyze", "--shape", "uniform"], "'uniform'", "valid: gaussian, quant, both")


def test_hub_id_offline(no_weights, tmp_path):
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    for cmd in (["eval", "ppl"], ["analyze"], ["calibrate", "--out", str(tmp_path / "o")]):
        _usage_error([*cmd, "some-org/some-model"], "'some-org/some-model'", "builtin:tiny-mla", "never downloads",
                     env=env)  # fmt: skip
    _usage_error(["demo", "--model", "some-org/some-model"], "'some-org/some-model'", env=env)
    _usage_error(["eval", "ppl", "not/a/valid/id"], "'not/a/valid/id'", "nor a valid hub id", env=env)


def _model_dir(tmp_path, meta) -> str:
    """A model directory with the bundled config and a quantmla.json, and no weights at all."""
    shutil.copy(builtin_path("tiny-mla") / "config.json", tmp_path / "config.json")
    (tmp_path / "quantmla.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return str(tmp_path)


GOOD_META = {"format": 1, "scheme": "c4r4", "method": "quantmla", "group_size": 64, "sink": 4, "recent": 128}


@pytest.mark.parametrize(
    "meta,fragments",
    [
        ([1, 2], ["expected a JSON object", "list"]),
        ('"c4r4"', ["expected a JSON object", "str"]),
        ("null", ["expected a JSON object", "NoneType"]),
        ("{not json", ["not valid JSON"]),
        (GOOD_META | {"scheme": "c5r4"}, ["'scheme'", "c5r4", "valid: bf16"]),
        (GOOD_META | {"sink": -1}, ["'sink'", "-1", ">= 0"]),
        (GOOD_META | {"group_size": 0}, ["'group_size'", ">= 1"]),
        (GOOD_META | {"group_size": 48}, ["'group_size'", "48", "divisors of 256"]),
        (GOOD_META | {"group_size": "64"}, ["'group_size'", "expected a JSON int"]),
        (GOOD_META | {"recent": True}, ["'recent'", "expected a JSON int"]),
        (GOOD_META | {"method": "gptq"}, ["'method'", "gptq", "valid: rtn"]),
        ({k: v for k, v in GOOD_META.items() if k != "scheme"}, ["missing keys ['scheme']"]),
    ],
)
def test_bad_quantmla_json(no_weights, tmp_path, meta, fragments):
    d = _model_dir(tmp_path, meta)
    for cmd in (["eval", "ppl", d], ["analyze", d], ["calibrate", d, "--out", str(tmp_path / "o")]):
        _usage_error(cmd, str(tmp_path / "quantmla.json"), *fragments)


def test_bad_scheme_method_group_before_any_weight(no_weights):
    _usage_error(["eval", "ppl", "--scheme", "c9r4"], "unknown cache scheme 'c9r4'", "valid: bf16, fp8")
    _usage_error(["eval", "ppl", "--scheme", "bf16,,c2r5"], "'c2r5'", "valid: bf16")
    _usage_error(["eval", "ppl", "--scheme", ","], "names no scheme", "valid: bf16")
    _usage_error(["eval", "ppl", "--seq-len", "8192"], "--seq-len 8192", "max_position_embeddings=4096")
    _usage_error(["eval", "lm-eval", "--tasks", "x", "--limit", "2.5"], "--limit 2.5", "a count")
    _usage_error(["eval", "ppl", "--scheme", "c4r4", "--group-size", "48"], "group_size=48", "divisors of 256")
    _usage_error(["eval", "ppl", "--scheme", "c4r4", "--group-size", "128"], "RoPE key", "divisors of 64")
    _usage_error(["demo", "--schemes", "bf16,int3"], "unknown cache scheme 'int3'", "valid: bf16")
    _usage_error(["calibrate", "--out", "x", "--method", "gptq"], "method='gptq'", "valid: rtn")
    _usage_error(["calibrate", "--out", "x", "--scheme", "c4r9"], "'c4r9'", "valid: bf16")
    _usage_error(["calibrate", "--out", "x", "--model-objective", "mse"], "'mse'", "valid: kl, ce")
    _usage_error(["calibrate", "--out", "x", "--model-rotation-lr", "0"], "rotation_lr=0.0", "must be > 0")


@pytest.mark.parametrize("error", [ValueError("something deep\n  went wrong"), KeyError("a genuine bug")])
def test_an_error_inside_the_work_is_a_traceback_labelled_a_bug(monkeypatch, error):
    """Every input is checked before the work begins, so an exception in it (a ValueError included) is a bug:
    its traceback and one line saying so, exit code 1; never a usage error."""
    import quantmla.eval.ppl as ppl

    def deep(*args, **kwargs):
        raise error

    monkeypatch.setattr(ppl, "perplexity", deep)
    res = runner.invoke(app, ["eval", "ppl", "--num-seqs", "1", "--seq-len", "16"])
    assert res.exit_code == 1, (res.exit_code, res.output)
    assert "Traceback" in res.output and "quantmla eval ppl: internal error, a bug" in res.output
    assert not any(ln.startswith("Error:") for ln in res.output.splitlines())


def test_calibrate_out_is_checked_before_any_weight(no_weights, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    _usage_error(["calibrate", "--out", str(tmp_path / "file")], "is a file; give a directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.txt").write_text("x")
    _usage_error(["calibrate", "--out", str(tmp_path / "full")], "is not empty", "--overwrite")
    import quantmla.cli.errors as errors

    monkeypatch.setattr(errors.os, "access", lambda path, mode: False)
    _usage_error(["calibrate", "--out", str(tmp_path / "new" / "dir")], "is not writable")


@pytest.mark.parametrize(
    ("changed", "says"), [(True, "transforms fused into the weights"), (False, "weights unchanged")]
)
def test_calibrate_says_whether_the_weights_changed(monkeypatch, tmp_path, changed, says):
    import quantmla.calibrate as calibrate
    import quantmla.calibrate.api as api

    report = SimpleNamespace(layers=[], model_level=None, codec=object(), weights_changed=changed)
    monkeypatch.setattr(calibrate, "calibrate_model", lambda m, tok, texts, **kw: (m, report))
    monkeypatch.setattr(api, "export_changed", lambda *a, **kw: {"changed": [], "rewritten": [], "linked": []})
    res = runner.invoke(app, ["calibrate", "--out", str(tmp_path / "o"), "--method", "rolaq", "--scheme", "c2r4",
                              "--num-seqs", "2", "--val-seqs", "1", "--seq-len", "64"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"rolaq: {says}; the per-layer cache codec" in " ".join(res.output.split())


def test_too_many_windows_is_one_line():
    res = runner.invoke(app, ["eval", "ppl", "--num-seqs", "100000", "--seq-len", "512"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and "num_seqs=100000 but the text holds only" in errors[0], res.output


def test_sequential_options_are_checked_before_any_weight(no_weights, tmp_path, monkeypatch):
    import quantmla.models.streaming as streaming

    def boom(*args, **kwargs):
        raise AssertionError("a layer was read before the bad input was reported")

    monkeypatch.setattr(streaming.CheckpointLayers, "layer", boom)
    monkeypatch.setattr(streaming.CheckpointLayers, "embedding", boom)
    out = ["--out", str(tmp_path / "o"), "--num-seqs", "2", "--val-seqs", "1", "--seq-len", "64"]
    _usage_error(["calibrate", *out, "--offload", "disk"], "--work-dir and --devices apply to --sequential")
    _usage_error(["calibrate", *out, "--sequential", "--offload", "nvme"], "offload='nvme'", "cpu, disk")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "x").write_text("x")
    _usage_error(["calibrate", *out, "--sequential", "--work-dir", str(tmp_path / "work")],
                 "is not a quantmla work directory")  # fmt: skip


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused(no_weights, tmp_path):
    from fp8_checkpoints import write_v3_fp8_checkpoint

    src = write_v3_fp8_checkpoint(tmp_path / "src", layers=1)  # vocab 512: the bundled tokenizer has 8192
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path("tiny-mla") / f, src / f)
    _usage_error(["calibrate", str(src), "--out", str(tmp_path / "o"), "--seq-len", "64", "--num-seqs", "2",
                  "--val-seqs", "1"], "beyond the model's vocab_size 512", "not this model's tokenizer")  # fmt: skip


@pytest.mark.parametrize(
    "command", [["eval", "ppl"], ["eval", "niah"], ["eval", "lm-eval", "--tasks", "x"], ["analyze"]]
)
def test_device_map_options_are_checked_before_any_weight(no_weights, command):
    _usage_error([*command, "--device-map", "auto", "--device", "cuda:7"], "give --device (cuda:7) or --device-map")
    _usage_error([*command, "--max-memory", "cpu=1GiB"], "--max-memory applies to --device-map auto")
    _usage_error([*command, "--device-map", "balanced"], "device_map='balanced'; valid: auto")


def test_eval_ppl_runs_with_a_device_map_and_says_so():
    res = runner.invoke(app, ["eval", "ppl", "--device-map", "auto", "--max-memory", "cpu=20MiB", "--num-seqs", "1",
                              "--seq-len", "128", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{") :])
    assert out["device"] == "device_map=auto" and out["results"][0]["ppl"] > 1
