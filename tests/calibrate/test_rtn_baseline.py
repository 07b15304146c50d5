"""RTN is the untouched model, and no method is worse than RTN on held-out data (issue 15, wrong result 2).

The references are computed here, independently of calibrate's own bookkeeping: the untouched
model's weights and perplexity, the layer error of quantising the model's own cached ``c`` (captured
with :mod:`quantmla.analysis`), and the held-out KL of each method's *fused* model under the
decode-cache simulation.
"""

import copy
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantmla
from quantmla.calibrate import calibrate_model, export
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.formats.scheme import parse_scheme
from quantmla.measure.attention import run_attention
from quantmla.measure.capture import capture_attention_call
from quantmla.measure.simulate import simulated_decode
from quantmla.models import get_adapter
from quantmla.models.loading import builtin_text
from tiny_models import tiny_model

METHODS = ("rtn", "smoothquant", "quarot", "quantmla")


def _float64_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def gained_model(name="deepseek_v3", seed=0):
    """A float64 tiny model whose latent gains g are far from 1, some negative (the tiny configs have g = 1)."""
    model = tiny_model(name, dtype=torch.float64, seed=seed)
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, attn in adapter.attention_modules(model):
            norm = adapter.kv_norm(attn)
            gain = torch.exp(0.8 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
            gain[::5] *= -1
            norm.weight.copy_(gain)
            norm.forward = types.MethodType(_float64_norm, norm)  # transformers' RMSNorm computes in float32
    return model


def test_rtn_is_the_untouched_model(tmp_path):
    """Bundled model (real gains): weights bit-identical, export byte-identical, perplexity equal exactly."""
    model, tok = quantmla.load()
    ref, _ = quantmla.load()
    model, report = calibrate_model(
        model, tok, builtin_text("validation"), scheme="c2r4", method="rtn", progress=False,
        steps=2, num_seqs=2, val_seqs=1, seq_len=64, batch_size=2, model_steps=0,
    )  # fmt: skip
    out = export(model, tok, tmp_path / "rtn", report)
    saved = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        saved.update(load_file(f))
    ref_sd = ref.state_dict()
    assert saved and set(saved) <= set(ref_sd)
    for name, tensor in saved.items():
        assert tensor.dtype == ref_sd[name].dtype and torch.equal(tensor, ref_sd[name]), name
    cfg = PerplexityConfig(scheme="c2r4", seq_len=128, num_seqs=4, sink=0, recent=0, batch_size=4)
    text = builtin_text("test")
    assert perplexity(model, tok, text, cfg, progress=False).ppl == perplexity(ref, tok, text, cfg, progress=False).ppl


def _rtn_content_errors(model, windows, batch_size, scheme, group_size):
    """Per layer: the held-out attention-output error of quantising the model's own cached c (mean over batches)."""
    fmt = parse_scheme(scheme).content
    errs = {}
    for idx, _ in get_adapter(model).attention_modules(model):
        vals = []
        for i in range(0, len(windows), batch_size):
            call = capture_attention_call(model, idx, windows[i : i + batch_size])
            with torch.no_grad():
                out, c, _ = run_attention(call)
                out_q = run_attention(call, delta_c=fmt.fake_quantize(c, group_size) - c)[0]
            vals.append(float((out_q - out).pow(2).sum() / out.pow(2).sum()))
        errs[idx] = sum(vals) / len(vals)
    return errs


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4"])
def test_no_method_is_worse_than_rtn_on_held_out_layer_errors(scheme):
    ids = torch.randint(3, 256, (6, 32), generator=torch.Generator().manual_seed(0))
    cfg = dict(scheme=scheme, steps=3, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False, model_steps=0)
    ref_model = quantmla.enable_latent_attention(gained_model())
    rtn = _rtn_content_errors(ref_model, ids[4:], 2, scheme, 64)
    for method in METHODS:
        _, rep = calibrate_model(gained_model(), None, ids, method=method, **cfg)
        for row in rep.layers:
            c, r = row["content"], row["rope"]
            # the original-basis candidate is RTN itself (c quantised as the model caches it)
            assert c["val_before"] == pytest.approx(rtn[row["layer"]], rel=1e-12, abs=0), (method, row["layer"])
            assert c["val_after"] <= rtn[row["layer"]] * (1 + 1e-12), (method, row["layer"], c)
            assert r["val_after"] <= r["val_before"], (method, row["layer"], r)
            assert c["init"] in c["candidate_val"] and c["val_after"] <= c["candidate_val"]["original"]
            if method != "quantmla":  # a baseline is its transform or the original basis, whichever validates
                assert c["val_after"] == min(c["candidate_val"].values())


def _held_out_kl(model, windows, scheme, batch_size, sink, recent):
    """Per-token KL(full precision || decode-cache simulation) over ``windows``, as the model-level stage defines it."""
    total = 0.0
    for w in torch.split(windows, batch_size):
        with torch.no_grad():
            ref = torch.log_softmax(model(w, use_cache=False).logits.float(), -1)
            with simulated_decode(model, scheme, 64, sink, recent):
                out = torch.log_softmax(model(w, use_cache=False).logits.float(), -1)
        kl = torch.nn.functional.kl_div(out.flatten(0, 1), ref.flatten(0, 1), log_target=True, reduction="batchmean")
        total += float(kl) * len(w)
    return total / len(windows)


def test_model_level_starts_are_rtn_and_the_fused_baselines():
    """Each model-level start's held-out KL is the KL its fused model really has; RTN's is the untouched model's."""
    ids = torch.randint(3, 256, (6, 32), generator=torch.Generator().manual_seed(0))
    cfg = dict(scheme="c2r4", steps=2, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False)
    windows = dict(sink=0, recent=0)
    _, rep = calibrate_model(gained_model(), None, ids, method="quantmla", model_steps=2, **windows, **cfg)
    start = rep.model_level["start_val"]
    assert set(start) == {"quantmla-layer", *METHODS[:3]}
    for method in METHODS[:3]:
        fused, _ = calibrate_model(gained_model(), None, ids, method=method, model_steps=0, **cfg)
        kl = _held_out_kl(fused, ids[4:], "c2r4", 2, **windows)
        assert start[method] == pytest.approx(kl, rel=1e-6), (method, start[method], kl)
    untouched = quantmla.enable_latent_attention(gained_model())
    assert start["rtn"] == pytest.approx(_held_out_kl(untouched, ids[4:], "c2r4", 2, **windows), rel=1e-6)
    assert rep.model_level["val_after"] <= min(start.values())


def test_rtn_fuses_nothing_with_negative_gains():
    """A model with negative latent gains: rtn leaves every weight bit-identical and reports the original basis."""
    model = gained_model()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 256, (6, 32), generator=torch.Generator().manual_seed(0))
    model, rep = calibrate_model(model, None, ids, method="rtn", scheme="c4r4", steps=1, num_seqs=4, val_seqs=2,
                                 seq_len=32, batch_size=2, progress=False)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
    assert [r["content"]["init"] for r in rep.layers] == ["original"] * len(rep.layers)
