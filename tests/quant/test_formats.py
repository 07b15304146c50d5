"""The related systems' quantiser formats: clipped g128 groups (RAQ-MLA's latent), per-channel pages
(RAQ-MLA's RoPE key), mixed widths per RoPE pair (Block-GTQ); their error bounds, BPE and storage formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.cache.paged_store import PagedPathStore
from quantmla.cache.store import PathStore
from quantmla.formats.packing import pack_mixed, packed_bytes, unpack_mixed
from quantmla.formats.scheme import PathFormat, parse_scheme
from quantmla.quant.clip import clip_threshold, quantize_clipped
from quantmla.quant.mixed import dequantize_mixed, pair_channel_bits, quantize_mixed

SEEDS = st.integers(0, 2**31 - 1)


def _x(seed: int, shape, outliers: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:  # a few large channels, as keys have
        x[..., :: max(1, shape[-1] // 5)] *= 12
    return x


@settings(max_examples=25, deadline=None)
@given(seed=SEEDS, bits=st.sampled_from([2, 3, 4]), group=st.sampled_from([64, 128]), q=st.floats(0.5, 1.0))
def test_clipped_groups_bound_the_error(seed, bits, group, q):
    x = _x(seed, (5, 256)).double()
    got = quantize_clipped(x, bits, group, q)
    xh = got.dequantize(torch.float64)
    c = clip_threshold(x, q).double()
    scale = got.scale.double().repeat_interleave(group, -1)
    inside = x.abs() <= c
    tol = 1e-6 * x.abs().max()
    assert ((x - xh).abs() <= scale / 2 + tol)[inside].all()  # the quantiser's bound where nothing is clipped
    assert ((x - xh).abs() <= x.abs() - c + scale / 2 + tol)[~inside].all()  # clipped: off by the cut, at most
    assert (xh.abs() <= c + scale / 2 + tol).all()


def test_clipping_lowers_int2_error_on_outlier_tokens():
    x = _x(0, (64, 512))
    plain = quantize_clipped(x, 2, 128, 1.0).dequantize()
    clipped = quantize_clipped(x, 2, 128, 0.94).dequantize()
    assert (clipped - x).pow(2).mean() < (plain - x).pow(2).mean()


@settings(max_examples=25, deadline=None)
@given(seed=SEEDS, widths=st.lists(st.sampled_from([0, 1, 2, 3, 4, 8]), min_size=32, max_size=32))
def test_mixed_widths_bound_the_error_and_pack_exactly(seed, widths):
    pairs = [(i, i + 32) for i in range(32)]  # rotate-half pairs of a 64-channel RoPE key
    bits = pair_channel_bits(tuple(widths), pairs)
    x = _x(seed, (3, 7, 64)).double()
    q = quantize_mixed(x, bits, 32)
    xh = q.dequantize(torch.float64)
    levels = torch.tensor([(1 << b) - 1 for b in bits], dtype=torch.float64).clamp_min(1)
    step = q.span.double().repeat_interleave(32, -1) / levels
    lo = q.minimum.double().repeat_interleave(32, -1)
    b = torch.tensor(bits)
    tol = 1e-6 * x.abs().max()
    ok = torch.where(b > 0, (x - xh).abs() <= step / 2 + tol, xh == lo)  # a zero width reads the minimum
    assert ok.all()
    packed = pack_mixed(q.codes, bits)
    assert packed.shape[-1] == packed_bytes(bits) == math.ceil(sum(bits) / 8)
    assert torch.equal(unpack_mixed(packed, bits), q.codes)
    assert torch.equal(dequantize_mixed(unpack_mixed(packed, bits), q.minimum, q.span, bits, 32), q.dequantize())


def test_mixed_at_one_width_is_the_uniform_quantiser():
    """One width everywhere: the uniform format's storage and, up to the fp16 rounding of span vs scale
    (codes at a rounding midpoint may land one level apart), its error."""
    x = _x(3, (256, 64))
    uni, mixed = parse_scheme("c4r4").rope, parse_scheme("c4rm4x64").rope
    assert mixed.bytes_per_token(64, 64) == uni.bytes_per_token(64, 64) == 36
    e_uni = (uni.fake_quantize(x, 64) - x).pow(2).mean()
    e_mixed = (mixed.fake_quantize(x, 64) - x).pow(2).mean()
    assert abs(e_mixed / e_uni - 1) < 0.02, (e_mixed, e_uni)


@pytest.mark.parametrize(
    ("name", "bpe"),
    [
        ("c4r4", (512 * 4.5 + 64 * 4.5) / 576),
        ("c2r4", (512 * 2.5 + 64 * 4.5) / 576),
        ("c2g128q94r4p128", (512 * (2 + 32 / 128) + 64 * (4 + 32 / 128)) / 576),  # RAQ-MLA's table: 2.47
        ("c2g128q94r4p64", (512 * (2 + 32 / 128) + 64 * (4 + 32 / 64)) / 576),  # 2.50 at pages of 64
        ("c4rm4x32-2x32", (512 * 4.5 + 32 * 4 + 32 * 2 + 32) / 576),
    ],
)
def test_bits_per_element_formula(name, bpe):
    assert parse_scheme(name).bits_per_element(512, 64, 64) == pytest.approx(bpe, rel=1e-12)


@pytest.mark.parametrize("name", ["c2g128q94r4", "c4rm4x16-3x16-2x32", "c2g128r4g32", "c3r8", "c4r4p8",
                                  "c4rm5x8-3x24-2x32p8"])  # fmt: skip
def test_storage_equals_the_formula(name):
    """PathStore's allocated bytes per token equal the format's formula, and reads back its fake quantisation."""
    s = parse_scheme(name)
    for fmt, dim in ((s.content, 512), (s.rope, 64)):
        x = _x(5, (2, 16, dim))
        if fmt.page is None:
            store = PathStore(fmt, dim, 64, 2, torch.float32, torch.device("cpu"), page_size=16)
        else:  # whole pages only: the page still filling is a buffer of P rows on top
            store = PagedPathStore(fmt, dim, 2, torch.float32, torch.device("cpu"), page_size=16)
        store.append(x[:, :5])
        store.append(x[:, 5:])  # tokens arrive in pieces; a paged store quantises each page once it is full
        extra = 0 if fmt.page is None else 2 * fmt.page * dim * 4
        assert store.nbytes() == 2 * 16 * fmt.bytes_per_token(dim, 64) + extra
        torch.testing.assert_close(store.dequantize(torch.float32), fmt.fake_quantize(x, 64), rtol=0, atol=0)


def test_names_round_trip_and_errors():
    for name in ["c4r4", "c2g128q94r4p128", "c4rm4x32-2x32", "c2g128r4g32", "c8q99.5r4"]:
        assert parse_scheme(name).name == name
        assert parse_scheme(parse_scheme(name).name) == parse_scheme(name)
    bads = [("c5r4", "bits=5"), ("c2q0r4", r"quantile 0\.0"), ("c2g64p64r4", "page=64"), ("c4rm4x64q90", "clip"),
            ("c4rm9x64", r"widths \[9\]"), ("c4r4x", "unknown cache scheme")]  # fmt: skip
    for bad, msg in bads:
        with pytest.raises(ValueError, match=msg):
            parse_scheme(bad)
    with pytest.raises(ValueError, match="held by PagedPathStore"):
        PathStore(PathFormat("int", 4, page=64), 64, 64, 1, torch.float32, torch.device("cpu"))


def test_paged_fake_quantisation_leaves_the_filling_page():
    fmt = parse_scheme("c4r4p16").rope
    x = _x(1, (2, 40, 64))
    y = fmt.fake_quantize(x, 64)
    assert torch.equal(y[:, 32:], x[:, 32:])  # 40 tokens: pages 0-15 and 16-31 full, 32-39 still filling
    assert not torch.equal(y[:, :32], x[:, :32])
    per_page = parse_scheme("c4r4p16").rope.fake_quantize(x[:, 16:32], 64)  # a page's stats are its own
    torch.testing.assert_close(y[:, 16:32], per_page, rtol=0, atol=0)
