"""calibrate_model and export against independent references.

* every method keeps the float64 function (logits to 1e-10, stock and latent attention);
* the layer errors it reports are the errors the *fused* model really has (its cache quantised as
  it is, measured here);
* on a model with outlier latent channels, where RTN must fail, the learned transform lowers the
  held-out error far below RTN's;
* export -> vanilla transformers / quantmla.load round-trips the function and the metadata.
"""

import copy
import json
import types

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import quantmla
from quantmla.calibrate import CalibrationConfig, calibrate_model, export, read_meta
from quantmla.calibrate.objectives import collect
from quantmla.cli.main import app
from quantmla.formats.scheme import parse_scheme
from quantmla.models import get_adapter
from quantmla.models.loading import builtin_text
from tiny_models import tiny_model

SMALL = dict(steps=4, num_seqs=2, val_seqs=1, seq_len=64, batch_size=2, model_steps=10)
TINY = dict(steps=6, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False)
RUNS = [("rtn", 0), ("smoothquant", 0), ("quarot", 0), ("quantmla", 0), ("quantmla", 3)]


def _float64_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _model(gains: str, seed: int = 0):
    """Float64 tiny DeepSeek-V3 with float64 latent norms and latent gains: ``random`` (some negative), or
    ``outliers`` (two channels 40x the others, the case a per-token quantiser handles worst)."""
    model = tiny_model("deepseek_v3", dtype=torch.float64, seed=seed)
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, attn in adapter.attention_modules(model):
            norm = adapter.kv_norm(attn)
            if gains == "random":
                gain = torch.exp(0.8 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
                gain[::5] *= -1
            else:
                gain = torch.ones_like(norm.weight)
                gain[[3, 70]] = 40.0
            norm.weight.copy_(gain)
            norm.forward = types.MethodType(_float64_norm, norm)
    return model


def _ids(n=6, t=32, seed=0):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method,model_steps", RUNS)
def test_every_method_keeps_the_float64_function(method, model_steps):
    model = _model("random")
    ref = copy.deepcopy(model)
    ids = _ids()
    fused, _ = calibrate_model(model, None, ids, scheme="c2r4", method=method, model_steps=model_steps, **TINY)
    probe = _ids(2, 24, seed=5)
    with torch.no_grad():
        want = ref(probe).logits
        assert (fused(probe).logits - want).abs().max().item() <= 1e-10  # latent attention (enabled by calibrate)
        quantmla.disable_latent_attention(fused)
        assert (fused(probe).logits - want).abs().max().item() <= 1e-10  # stock attention on the fused weights
    pairs = zip(fused.state_dict().values(), ref.state_dict().values(), strict=True)
    changed = any(not torch.equal(a, b) for a, b in pairs)
    assert changed == (method != "rtn")


def _fused_rtn_errors(model, windows, scheme, group_size, batch_size):
    """Per layer: (content, RoPE) held-out errors of quantising what ``model`` caches, no transform."""
    s = parse_scheme(scheme)
    from quantmla.measure.attention import run_attention

    errs = {}
    for idx, _ in get_adapter(model).attention_modules(model):
        c_err, r_err = [], []
        for b in collect(model, idx, windows, batch_size):
            with torch.no_grad():
                out = run_attention(b.call, delta_c=s.content.fake_quantize(b.c, group_size) - b.c)[0]
                c_err.append(float((out - b.out).pow(2).sum() / b.out.pow(2).sum()))
                k = b.r[:, 0]
                dk = s.rope.fake_quantize(k, group_size) - k
                causal = torch.ones(k.shape[1], k.shape[1], dtype=torch.bool).tril()
                err = (b.q_pe @ dk.unsqueeze(1).transpose(-1, -2)).masked_fill(~causal, 0)
                ref = (b.q_pe @ k.unsqueeze(1).transpose(-1, -2)).masked_fill(~causal, 0)
                r_err.append(float(err.pow(2).sum() / ref.pow(2).sum()))
        errs[idx] = (sum(c_err) / len(c_err), sum(r_err) / len(r_err))
    return errs


@pytest.mark.parametrize("method,model_steps", RUNS)
def test_reported_layer_errors_are_the_fused_models(method, model_steps):
    """The report's final per-layer errors equal those measured on the fused model (its cache quantised as is)."""
    ids = _ids()
    fused, rep = calibrate_model(_model("random"), None, ids, scheme="c2r4", method=method, model_steps=model_steps,
                                 sink=0, recent=0, **TINY)  # fmt: skip
    measured = _fused_rtn_errors(fused, ids[4:], "c2r4", 64, 2)
    key = "val_final" if model_steps else "val_after"
    for row in rep.layers:
        c, r = measured[row["layer"]]
        assert row["content"][key] == pytest.approx(c, rel=1e-9), (row["layer"], row["content"], c)
        assert row["rope"][key] == pytest.approx(r, rel=1e-9), (row["layer"], row["rope"], r)


def test_learning_lowers_the_error_where_rtn_must_fail():
    """Two latent channels 40x the others: RTN's INT2 groups spend their range on them. QuantMLA's layer stage
    must cut the held-out layer error several-fold, the fused model must keep most of that gain (measured on
    it), and the model-level stage must cut the held-out KL of the untouched model (its RTN start) too."""
    ids = _ids(10, 32)
    untouched = quantmla.enable_latent_attention(_model("outliers"))
    rtn = _fused_rtn_errors(untouched, ids[8:], "c2r4", 64, 2)
    fused, rep = calibrate_model(_model("outliers"), None, ids, scheme="c2r4", method="quantmla", sink=0, recent=0,
                                 model_steps=5, **{**TINY, "num_seqs": 8, "steps": 10})  # fmt: skip
    after = _fused_rtn_errors(fused, ids[8:], "c2r4", 64, 2)
    for row in rep.layers:
        c_rtn = rtn[row["layer"]][0]
        assert row["content"]["val_after"] < 0.3 * c_rtn, (row["layer"], row["content"], c_rtn)
        assert after[row["layer"]][0] < 0.5 * c_rtn, (row["layer"], after[row["layer"]], c_rtn)
    assert rep.model_level["val_after"] < 0.4 * rep.model_level["start_val"]["rtn"], rep.model_level


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model, tok = quantmla.load()
    ids = tok(builtin_text("test")[:2000], return_tensors="pt").input_ids[:, :48]
    with torch.no_grad():
        before = model(ids).logits
    model, report = calibrate_model(
        model, tok, builtin_text("validation"), scheme="c2r4", method="quantmla", progress=False, **SMALL
    )
    out = export(model, tok, tmp_path_factory.mktemp("calibrated"), report)
    return out, ids, before, report


def test_export_round_trip_through_vanilla_transformers(calibrated):
    out, ids, before, _ = calibrated
    vanilla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        after = vanilla(ids).logits
    # float32 weights rounded after fusion: a few float32 ulps of the logit scale
    assert (after - before).abs().max().item() <= 1e-4 * before.abs().max().item()
    reloaded, _ = quantmla.load(str(out))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, after)  # quantmla.load reads back exactly what was written


def test_meta_and_reload(calibrated):
    out, _, _, report = calibrated
    meta = read_meta(out)
    assert meta["scheme"] == "c2r4" and meta["method"] == "quantmla" and meta["steps"] == 4
    assert meta["dtype"] == "float32" and meta["sink"] == 4 and meta["recent"] == 128
    assert meta["model_level"]["val_after"] <= min(meta["model_level"]["start_val"].values())
    assert meta["calibration"]["data_sha256"] == report.data_sha256 and len(meta["layers"]) == 8
    assert meta["layers"] == json.loads(json.dumps(report.layers))
    model, _ = quantmla.load(str(out))
    assert model.quantmla_meta == meta


GOOD = {"format": 1, "scheme": "c4r4", "method": "rtn", "group_size": 64, "sink": 4, "recent": 128}


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"format": 1, "scheme": "c4r4"}), r"missing keys \['method', 'group_size', 'sink', 'recent'\]"),
        (json.dumps({**GOOD, "scheme": "c9r4"}), "key 'scheme': unknown cache scheme"),
        (json.dumps({**GOOD, "format": 99}), "format 99"),
        (json.dumps({**GOOD, "group_size": True}), "key 'group_size' is True"),
        (json.dumps({**GOOD, "group_size": "64"}), "key 'group_size' is '64'"),
        (json.dumps({**GOOD, "sink": -1}), "key 'sink' is -1"),
        (json.dumps({**GOOD, "method": "gptq"}), "key 'method' is 'gptq'; valid: rtn, smoothquant, quarot, quantmla"),
    ],
)
def test_corrupt_or_mismatched_meta_fails_before_loading(calibrated, tmp_path, text, match):
    out, _, _, _ = calibrated
    (tmp_path / "quantmla.json").write_text(text)
    (tmp_path / "config.json").write_text("{broken")  # never reached: the meta is read first
    with pytest.raises(ValueError, match=match) as e:
        quantmla.load(str(tmp_path))
    assert str(tmp_path / "quantmla.json") in str(e.value)


def test_config_errors():
    with pytest.raises(ValueError, match="method='gptq'; valid: rtn, smoothquant, quarot, quantmla"):
        CalibrationConfig(method="gptq")
    with pytest.raises(ValueError, match="does not quantise"):
        CalibrationConfig(scheme="bf16")


def test_cli_calibrate_then_eval_uses_the_exported_scheme(tmp_path):
    runner = CliRunner()
    args = ["calibrate", "--out", str(tmp_path / "m"), "--method", "quarot", "--scheme", "c2r4", "--steps", "0"]
    res = runner.invoke(app, [*args, "--num-seqs", "2", "--val-seqs", "1", "--seq-len", "64"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["eval", "ppl", str(tmp_path / "m"), "--num-seqs", "1", "--seq-len", "128", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{") :])
    assert out["results"][0]["scheme"] == "c2r4" and out["results"][0]["recent"] == 128


def test_cli_calibrate_model_level_flags(tmp_path):
    runner = CliRunner()
    args = ["calibrate", "--out", str(tmp_path / "m"), "--steps", "1", "--num-seqs", "2", "--val-seqs", "1"]
    args += ["--seq-len", "64", "--batch-size", "2", "--no-sink-recent"]
    res = runner.invoke(app, [*args, "--model-objective", "mse"])
    assert res.exit_code != 0 and "valid: kl, ce" in res.output
    res = runner.invoke(app, [*args, "--model-steps", "2", "--model-objective", "ce"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "model level (ce, sink 0 + recent 0)" in res.output
    meta = read_meta(tmp_path / "m")
    assert meta["model_level"]["steps"] == 2 and meta["model_level"]["objective"] == "ce"
    assert meta["sink"] == 0 and meta["model_level"]["init"] in meta["model_level"]["start_val"]
