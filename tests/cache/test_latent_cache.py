import numpy as np
import pytest
import torch

from quantmla import QuantizedLatentCache
from quantmla.formats import parse_scheme
from tiny_models import tiny_config

CFG = tiny_config("deepseek_v3")  # latent 128, RoPE 64
DC, DR = 128, 64


def _feed(cache, c, r, layer=0, step=1):
    out = None
    for t in range(0, c.shape[2], step):
        out = cache.update(c[:, :, t : t + step], r[:, :, t : t + step], layer)
    return out


def _fp16_towards(x: np.ndarray, direction: float) -> np.ndarray:
    """The nearest fp16 at or beyond float64 ``x`` in ``direction`` (as float64)."""
    y = x.astype(np.float16)
    off = y.astype(np.float64) > x if direction < 0 else y.astype(np.float64) < x
    y[off] = np.nextafter(y[off], np.float16(direction))
    return y.astype(np.float64)


def affine_by_hand(x: torch.Tensor, bits: int, group: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of ``group`` channels, in float64: minimum = min rounded down to fp16, scale =
    (max - minimum) / (2^bits - 1) rounded up to fp16, code = round((x - minimum) / scale). Returns the
    dequantised values and the tolerance per element: 1e-6, or one step where the quotient lies within
    float32 rounding of a tie (the cache divides in float32)."""
    xs = x.float().double().numpy()  # the cache quantises the float32 value of its input
    g = xs.reshape(*xs.shape[:-1], -1, group)
    qmax = 2**bits - 1
    mn = _fp16_towards(g.min(-1, keepdims=True), -np.inf)
    sc = _fp16_towards((g.max(-1, keepdims=True) - mn) / qmax, np.inf)
    quot = (g - mn) / np.where(sc > 0, sc, 1)
    codes = np.where(sc > 0, np.clip(np.round(quot), 0, qmax), 0)
    tie = np.abs(quot - np.floor(quot) - 0.5) < 1e-4
    tol = np.where(tie, sc + 1e-6, 1e-6)
    return torch.from_numpy((codes * sc + mn).reshape(xs.shape)), torch.from_numpy(tol.reshape(xs.shape))


def fp8_by_hand(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """Per tile of 128 values: a power-of-two scale putting the tile's max at or below 448, e4m3 values."""
    g = x.double().unflatten(-1, (-1, tile))
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True) / 448.0)))
    return ((g.float() / scale.float()).to(torch.float8_e4m3fn).double() * scale).flatten(-2)


def _ref_quant(x, fmt):
    """(reference values, tolerance per element) of ``x`` stored in ``fmt``."""
    if fmt.kind == "int":
        return affine_by_hand(x, fmt.bits)
    ref = fp8_by_hand(x) if fmt.kind == "fp8" else x
    return ref, torch.full_like(ref, 1e-6)


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4", "c8r8", "c3r4", "fp8"])
@pytest.mark.parametrize("sink,recent", [(4, 16), (0, 0), (2, 0), (0, 5)])
def test_decode_view_sinks_quantised_middle_recent(scheme, sink, recent):
    T = 70
    c = torch.randn(2, 1, T, DC, dtype=torch.float64)
    r = torch.randn(2, 1, T, DR, dtype=torch.float64)
    cache = QuantizedLatentCache(CFG, scheme=scheme, sink=sink, recent=recent, page_size=16)
    out_c, out_r = _feed(cache, c, r)
    fmt = parse_scheme(scheme)
    n_mid = T - sink - recent
    for out, x, path in ((out_c, c, fmt.content), (out_r, r, fmt.rope)):
        ref, tol = _ref_quant(x[:, 0, sink : sink + n_mid], path)
        exp = torch.cat([x[:, 0, :sink], ref, x[:, 0, T - recent :]], 1)
        tol = torch.cat([torch.zeros_like(x[:, 0, :sink]), tol, torch.zeros_like(x[:, 0, T - recent :])], 1)
        assert out.shape == (2, 1, T, x.shape[-1])
        assert ((out[:, 0] - exp).abs() <= tol).all(), float((out[:, 0] - exp).abs().max())
    assert cache.get_seq_length() == T


def test_multi_token_update_returns_new_tokens_as_computed():
    c = torch.randn(1, 1, 50, DC)
    r = torch.randn(1, 1, 50, DR)
    cache = QuantizedLatentCache(CFG, scheme="c2r4", sink=1, recent=4)
    out_c, out_r = cache.update(c[:, :, :40], r[:, :, :40], 0)
    assert torch.equal(out_c, c[:, :, :40]) and torch.equal(out_r, r[:, :, :40])
    out_c, _ = cache.update(c[:, :, 40:], r[:, :, 40:], 0)
    assert torch.equal(out_c[:, :, 40:], c[:, :, 40:])  # this call's own tokens at full precision
    ref, tol = affine_by_hand(c[:, 0, 1:36], 2)
    assert ((out_c[:, 0, 1:36].double() - ref).abs() <= tol + 1e-6).all()  # earlier ones as stored
    assert not torch.equal(out_c[:, 0, 1:36], c[:, 0, 1:36])


def test_tokens_are_quantised_once():
    c = torch.randn(1, 1, 40, DC)
    r = torch.randn(1, 1, 40, DR)
    cache = QuantizedLatentCache(CFG, scheme="c4r4", sink=0, recent=2, page_size=8)
    _feed(cache, c[:, :, :20], r[:, :, :20])
    layer = cache.layers[0]
    snap = layer.mid_c.tensors["codes"][:, :18].clone()
    _feed(cache, c[:, :, 20:], r[:, :, 20:])
    assert torch.equal(layer.mid_c.tensors["codes"][:, :18], snap)


@pytest.mark.parametrize(
    "scheme,per_token", [("c4r4", 324), ("c2r4", 196), ("c8r8", 612), ("fp8", 656), ("bf16", 1152)]
)
def test_bytes_measured_from_storage_match_formula(scheme, per_token):
    # production geometry: latent 512, RoPE 64, bf16 windows
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(num_hidden_layers=1, kv_lora_rank=512, qk_rope_head_dim=64)
    cache = QuantizedLatentCache(cfg, scheme=scheme, sink=4, recent=128)
    T = 4096
    c = torch.randn(1, 1, T, 512, dtype=torch.bfloat16)
    r = torch.randn(1, 1, T, 64, dtype=torch.bfloat16)
    cache.update(c, r, 0)
    assert cache.cache_config.persistent_bytes_per_token() == per_token
    formula = per_token * (T - 132) + 1152 * 132 if scheme != "bf16" else 1152 * T
    assert abs(cache.nbytes() - formula) / formula < 0.02
    assert cache.nbytes() >= formula


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown cache scheme 'int4'"):
        QuantizedLatentCache(CFG, scheme="int4")
    with pytest.raises(ValueError, match="group_size=48 does not divide"):
        QuantizedLatentCache(CFG, scheme="c4r4", group_size=48)
    with pytest.raises(ValueError, match="c6r4"):
        QuantizedLatentCache(CFG, scheme="c6r4")
    with pytest.raises(ValueError, match="sink=-1"):
        QuantizedLatentCache(CFG, sink=-1)
    cache = QuantizedLatentCache(CFG, scheme="c4r4")
    with pytest.raises(ValueError, match="built for latent dim 128 and RoPE dim 64.*another model"):
        cache.update(torch.randn(1, 1, 3, 512), torch.randn(1, 1, 3, 64), 0)
    with pytest.raises(ValueError, match="layer_idx=7 out of range"):
        cache.update(torch.randn(1, 1, 3, DC), torch.randn(1, 1, 3, DR), 7)


def test_reorder_cache_selects_rows():
    c = torch.randn(3, 1, 30, DC)
    r = torch.randn(3, 1, 30, DR)
    cache = QuantizedLatentCache(CFG, scheme="c4r4", sink=1, recent=3)
    _feed(cache, c, r)
    full_c, _ = cache.update(c[:, :, :1], r[:, :, :1], 0)
    cache2 = QuantizedLatentCache(CFG, scheme="c4r4", sink=1, recent=3)
    _feed(cache2, c, r)
    cache2.reorder_cache(torch.tensor([2, 0]))
    sel_c, _ = cache2.update(c[[2, 0], :, :1], r[[2, 0], :, :1], 0)
    assert torch.equal(sel_c, full_c[[2, 0]])
