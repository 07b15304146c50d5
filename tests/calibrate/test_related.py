"""The seed papers' codec methods (RAQ-MLA, Block-GTQ) through calibrate_model, export and the eval commands.

* RAQ-MLA's fitted write-side transforms, with the read side compensating (A_c^-1 in W_UK and W_UV, A_R^-T on
  the query), keep the float64 logits (<= 1e-9) when nothing is quantised;
* its held-out attention-output error is never above the original basis' (and its Hadamard start's);
* Block-GTQ's per-layer widths spend exactly the budget, differ by layer, and the codec round-trips the export.
"""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from float64_codec import float64_norms, unquantised_logit_gap
from quantmla.calibrate import CalibrationConfig, calibrate_model, export, layer_stage
from quantmla.cli.main import app
from quantmla.measure.simulate import simulated_decode
from quantmla.models.loading import inspect_model
from tiny_models import tiny_model

TINY = dict(num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False)


def _ids(n=6, t=32, seed=0):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_raq_transforms_are_exact_at_full_precision_and_never_worse_held_out():
    model = tiny_model("deepseek_v3", dtype=torch.float64)
    _, report = calibrate_model(model, None, _ids(), scheme="c2g64q94r4p8", method="raq", **TINY)
    codec = report.codec
    assert any(lc.content.transform is not None or lc.rope.transform is not None for lc in codec.layers)
    assert not report.weights_changed  # RAQ-MLA's transforms are the codec's, not the weights'
    for row in report.layers:
        for path in ("content", "rope"):
            vals = row[path]["candidate_val"]
            assert row[path]["val_after"] <= min(vals.values()) + 1e-15
    # the same transforms with nothing quantised: the float64 function is kept (query compensation included)
    assert unquantised_logit_gap(model, codec, _ids(2, 24, seed=5)) <= 1e-9


def test_blockgtq_spends_the_budget_per_layer_and_round_trips_the_export(tmp_path):
    model = tiny_model("deepseek_v2", dtype=torch.float32)
    _, report = calibrate_model(model, None, _ids(), scheme="c4r3t", method="blockgtq", **TINY)
    widths = [lc.rope.fmt.widths(64) for lc in report.codec.layers]
    assert all(sum(w) == 3 * 64 for w in widths)  # mean 3 bits a channel (both channels of a pair alike)
    assert all(lc.rope.fmt.turbo and lc.content.fmt.spec == "4" for lc in report.codec.layers)

    class Tok:  # export saves a tokenizer; the tiny models have none
        def save_pretrained(self, path):
            (tmp_path / "m" / "tokenizer_config.json").write_text("{}")

    export(model, Tok(), tmp_path / "m", report)
    meta = json.loads((tmp_path / "m" / "quantmla.json").read_text())
    assert meta["method"] == "blockgtq" and meta["layer_schemes"] == [lc.scheme.name for lc in report.codec.layers]
    back = inspect_model(str(tmp_path / "m")).codec
    assert [lc.scheme.name for lc in back.layers] == meta["layer_schemes"]


def test_raq_codec_round_trips_the_export(tmp_path):
    model = tiny_model("deepseek_v3", dtype=torch.float32)
    _, report = calibrate_model(model, None, _ids(), scheme="c2r4", method="raq", **TINY)

    class Tok:
        def save_pretrained(self, path):
            pass

    export(model, Tok(), tmp_path / "m", report)
    back = inspect_model(str(tmp_path / "m")).codec
    for a, b in zip(report.codec.layers, back.layers, strict=True):
        for path in ("content", "rope"):
            ta, tb = getattr(a, path).transform, getattr(b, path).transform
            assert (ta is None and tb is None) or torch.equal(ta.double(), tb)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "blockgtq", "--scheme", "c4r3"], "needs a uniform TQ-MSE RoPE path"),
        (["--method", "rolaq", "--scheme", "bf16"], "does not quantise"),
    ],
)
def test_cli_refuses_schemes_a_method_cannot_calibrate(tmp_path, args, message):
    res = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "m"), *args])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize(
    "method,scheme", [("rolaq", "c2r4"), ("quantmla-raq", "c2g64q94r4t"), ("quantmla-raq", "c2g64q94r4p8")]
)
def test_rolaq_and_quantmla_raq_keep_the_float64_function(method, scheme):
    model = tiny_model("deepseek_v3", dtype=torch.float64)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        float64_norms(m)
    fused, report = calibrate_model(model, None, _ids(), scheme=scheme, method=method, steps=6, model_steps=3, **TINY)
    assert unquantised_logit_gap(fused, report.codec, _ids(2, 24, seed=5), reference=ref) <= 1e-9
    changed = any(not torch.equal(a, b) for a, b in zip(fused.state_dict().values(), ref.state_dict().values(),
                                                          strict=True))  # fmt: skip
    assert changed  # a rotation (RoLaQ) or QuantMLA's transforms were fused
    assert report.weights_changed  # and the report says so (the CLI's message reads it)
    for row in report.layers:
        if method == "rolaq":
            assert row["content"]["val_after"] <= min(row["content"]["candidate_val"].values()) + 1e-12
            continue
        for path in ("content", "rope"):  # the combined method: the better of RAQ-MLA's fits from both bases
            part = row["raq"][path]
            assert part["basis"] in ("fused", "unfused")
            best = min(min(part[b]["candidate_val"].values()) for b in ("fused", "unfused"))
            assert part["val_after"] <= best + 1e-12
    if method == "rolaq":
        learned = [lc.content for lc in report.codec.layers if lc.content.clip_ratio is not None]
        assert learned and all(bool(((c.clip_ratio > 0) & (c.clip_ratio <= 1)).all()) for c in learned)


def test_raq_fits_its_post_rope_transform_at_the_served_context():
    model = tiny_model("deepseek_v3", dtype=torch.float32)
    _, report = calibrate_model(model, None, _ids(), scheme="c2r4", method="raq", model_seq_len=64, **TINY)
    assert all(row["content"]["seq_len"] == 32 and row["rope"]["seq_len"] == 64 for row in report.layers)
    # its own window length, apart from the model stage's: the combined method fits both of its bases there
    _, report = calibrate_model(tiny_model("deepseek_v3", dtype=torch.float32), None, _ids(), scheme="c2r4",
                                method="quantmla-raq", steps=2, model_steps=1, rope_fit_seq_len=64, **TINY)  # fmt: skip
    assert all(row["raq"]["rope"][b]["seq_len"] == 64 and row["raq"]["content"][b]["seq_len"] == 32
               for row in report.layers for b in ("fused", "unfused"))  # fmt: skip


def test_quantmla_raq_reuses_quantmla_layer_stage():
    # the combined method's layer stage is QuantMLA's: a stage saved by one serves the other, and the combined
    # run on it gives the same fused weights as the combined run that computed its own stage
    model = tiny_model("deepseek_v3", dtype=torch.float32)
    kw = dict(scheme="c2r4", steps=4, model_steps=0, **TINY)
    assert CalibrationConfig(method="quantmla-raq").layer_key() == CalibrationConfig(method="quantmla").layer_key()
    assert CalibrationConfig(method="raq").layer_key() != CalibrationConfig(method="quantmla").layer_key()
    stage = layer_stage(copy.deepcopy(model), None, _ids(), method="quantmla", **kw)
    reused, _ = calibrate_model(copy.deepcopy(model), None, _ids(), method="quantmla-raq", layer_stage=stage, **kw)
    fresh, _ = calibrate_model(copy.deepcopy(model), None, _ids(), method="quantmla-raq", **kw)
    for a, b in zip(reused.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_combined_method_carries_the_unfused_fit_exactly():
    # RAQ-MLA fitted on the unfused model, carried to QuantMLA's fused model as U^-1 A, quantises the same
    # values: the quantised float64 logits agree (a wrong U^-1, e.g. transposed, fails this). DeepSeek-V3's
    # module, as the other float64 tests: V2's RoPE runs in complex64, so its fused model differs at ~4e-7.
    from quantmla.calibrate.combined import pick, undo_maps
    from quantmla.models.adapter import get_adapter

    torch.manual_seed(0)
    scheme = "c2g64q94r4p8"
    unfused = tiny_model("deepseek_v3", dtype=torch.float64)
    fused = copy.deepcopy(unfused)
    for m in (unfused, fused):  # after the copy: the patched norms hold their own module
        float64_norms(m)
    _, raq = calibrate_model(unfused, None, _ids(), scheme=scheme, method="raq", **TINY)
    _, rep = calibrate_model(fused, None, _ids(), scheme=scheme, method="quantmla", steps=6, model_steps=0, **TINY)
    adapter = get_adapter(unfused)
    chosen = rep.layer_stage.chosen
    assert any(not torch.equal(chosen[i][0].rotation, torch.diag(chosen[i][0].rotation.diagonal())) for i in chosen)
    undo = undo_maps(unfused, adapter, list(adapter.attention_modules(unfused)), chosen, ("content", "rope"))
    never = [{"content": {"val_after": float("inf")}, "rope": {"val_after": float("inf")}} for _ in undo]
    codec, rows = pick("carried", (raq.codec, never), (raq.codec, raq.layers), undo)
    assert all(r[p]["basis"] == "unfused" for r in rows for p in ("content", "rope"))
    probe = _ids(2, 24, seed=5)
    with torch.no_grad():
        with simulated_decode(unfused, raq.codec, sink=1, recent=2):
            want = unfused(probe, use_cache=False).logits
        with simulated_decode(fused, codec, sink=1, recent=2):
            got = fused(probe, use_cache=False).logits
        with simulated_decode(fused, raq.codec, sink=1, recent=2):  # the unfused fit uncarried: not the same
            wrong = fused(probe, use_cache=False).logits
    assert (got - want).abs().max().item() <= 1e-9
    assert (wrong - want).abs().max().item() > 1e-3
