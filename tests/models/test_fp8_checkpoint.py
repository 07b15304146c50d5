"""FP8 block-quantised checkpoints (DeepSeek-V3's format): quantmla reads them itself (partial blocks included,
which transformers' CPU path refuses), every bad input is one clear error before a weight is read, and the
block quantiser round-trips within the e4m3 grid."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8_checkpoints import write_v3_fp8_checkpoint
from quantmla.models.fp8_checkpoint import Fp8Blocks, dequantize_blocks, quantize_blocks
from quantmla.models.loading import inspect_model, load_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_v3_fp8_checkpoint(tmp_path_factory.mktemp("v3fp8"))


def _reference_state(path):
    """Every tensor of the checkpoint dequantised in float64 here, independently of quantmla's reader."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    ref = {}
    for name, t in out.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = out[name + "_scale_inv"].double()
            rows, cols = t.shape
            full = torch.kron(s, torch.ones(128, 128, dtype=torch.float64))[:rows, :cols]
            t = t.double() * full
        ref[name] = t.float()
    return ref


def test_the_576_row_projection_has_a_partial_block(ckpt):
    with safe_open(str(ckpt / "model-00002-of-00003.safetensors"), framework="pt") as a, safe_open(
        str(ckpt / "model-00003-of-00003.safetensors"), framework="pt") as b:  # fmt: skip
        shapes = {k: (a if k in a.keys() else b).get_slice(k).get_shape() for k in [*a.keys(), *b.keys()]}
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == [576, 256]
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == [5, 2]


def test_quantmla_loads_the_fp8_checkpoint_exactly(ckpt):
    src = inspect_model(ckpt)
    assert src.fp8 == Fp8Blocks((128, 128))
    model = load_model(src, dtype=torch.float32)  # the checkpoint has no tokenizer: the model alone
    ref = _reference_state(ckpt)
    got = {k: v for k, v in model.state_dict().items()}
    a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    torch.testing.assert_close(got[a], ref[a], rtol=0, atol=0)
    # the experts, fused by transformers' loader from the checkpoint's per-expert weights
    gate_up = got["model.layers.1.mlp.experts.gate_up_proj"]
    e0 = torch.cat(
        [ref["model.layers.1.mlp.experts.0.gate_proj.weight"], ref["model.layers.1.mlp.experts.0.up_proj.weight"]]
    )
    torch.testing.assert_close(gate_up[0], e0, rtol=0, atol=0)
    x = torch.randint(3, 500, (1, 9))
    assert torch.isfinite(model(x).logits).all()


def _corrupt(ckpt, tmp_path, edit):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    edit(bad)
    return bad


def _drop(bad, name):
    for f in bad.glob("*.safetensors"):
        state = load_file(str(f))
        if name in state:
            del state[name]
            save_file(state, str(f))


def test_bad_checkpoints_are_one_clear_error_before_any_weight(ckpt, tmp_path, monkeypatch):
    import quantmla.models.loading as loading

    monkeypatch.setattr(loading, "read_state_dict", lambda *a, **k: pytest.fail("weights were read"))
    scale = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    bad = _corrupt(ckpt, tmp_path / "1", lambda d: (d / "model-00003-of-00003.safetensors").unlink())
    with pytest.raises(ValueError, match="names shards that are missing: \\['model-00003-of-00003.safetensors'\\]"):
        load_model(bad)
    bad = _corrupt(ckpt, tmp_path / "2", lambda d: _drop(d, scale))
    with pytest.raises(ValueError, match="kv_a_proj_with_mqa.weight is float8 but its scale .* is missing"):
        load_model(bad)

    def wrong_grid(d):
        for f in d.glob("*.safetensors"):
            state = load_file(str(f))
            if scale in state:
                state[scale] = torch.ones(4, 2)
                save_file(state, str(f))

    bad = _corrupt(ckpt, tmp_path / "3", wrong_grid)
    with pytest.raises(ValueError, match="weight_scale_inv has shape \\[4, 2\\]; .* needs \\[5, 2\\]"):
        load_model(bad)

    def awq(d):
        raw = json.loads((d / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
        (d / "config.json").write_text(json.dumps(raw))

    bad = _corrupt(ckpt, tmp_path / "4", awq)
    with pytest.raises(ValueError, match="quant_method='awq': quantmla reads unquantised checkpoints and FP8"):
        load_model(bad)


def test_block_quantiser_round_trips_within_the_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-2, 1, 300)[:, None]
    blocks = Fp8Blocks((128, 128))
    codes, s = quantize_blocks(w, blocks)
    assert s.shape == (3, 2) and codes.dtype == torch.float8_e4m3fn
    back = dequantize_blocks(codes, s, blocks)
    full = torch.kron(s, torch.ones(128, 128))[:300, :200]
    # in the scaled domain v = w / s, e4m3 rounds to 3 mantissa bits: half an ulp is 2^-4 of |v| for a normal
    # value, and 2^-10 for a subnormal one (|v| < 2^-6)
    v = w / full
    bound = full * torch.maximum(v.abs() * 2.0**-4, torch.full_like(v, 2.0**-10)) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert ((back - w).abs() > 0).any()  # and it does round
    assert torch.allclose(back.abs().amax(), w.abs().amax())
