import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.quant import QUANT_BITS, dequantize_groups, quantize_groups

FP32_EPS = float(np.finfo(np.float32).eps)

groups = st.sampled_from([8, 16, 64])
bits_st = st.sampled_from(QUANT_BITS)


@st.composite
def grouped_arrays(draw):
    g = draw(groups)
    n_groups = draw(st.integers(1, 4))
    rows = draw(st.integers(1, 3))
    elements = st.floats(-1000, 1000, allow_nan=False, allow_infinity=False, width=32)
    arr = draw(hnp.arrays(np.float32, (rows, n_groups * g), elements=elements))
    return torch.from_numpy(arr), g


@settings(max_examples=200, deadline=None)
@given(grouped_arrays(), bits_st)
def test_error_bounded_by_half_scale(xg, bits):
    x, g = xg
    q = quantize_groups(x, bits, g)
    x_hat = q.dequantize(torch.float64)
    scale = q.scale.double().repeat_interleave(g, dim=-1)
    minimum = q.minimum.double().repeat_interleave(g, dim=-1)
    # the stored fp16 grid covers every element ...
    assert (minimum <= x.double()).all()
    top = minimum + scale * (2**bits - 1)
    assert (x.double() <= top + 1e-12 * (minimum.abs() + top.abs())).all()  # float64 rounding of max - min
    # ... so rounding to it errs by at most half a step (plus float32 evaluation of code*scale+min)
    arith = 4 * FP32_EPS * (x.double().abs() + minimum.abs() + scale * (2**bits - 1))
    err = (x.double() - x_hat).abs()
    assert (err <= scale / 2 + arith).all(), float((err - scale / 2 - arith).max())
    assert int(q.codes.max()) <= 2**bits - 1


@settings(max_examples=100, deadline=None)
@given(st.floats(-1000, 1000, allow_nan=False, width=32), groups, bits_st)
def test_constant_groups(value, g, bits):
    x = torch.full((2, 2 * g), value, dtype=torch.float32)
    q = quantize_groups(x, bits, g)
    x_hat = q.dequantize(torch.float64)
    assert torch.isfinite(x_hat).all()
    fp16_exact = float(torch.tensor(value).half().float()) == value
    if fp16_exact:  # representable minimum: zero scale, exact reconstruction
        assert (q.scale == 0).all() and torch.equal(x_hat, x.double())
    bound = q.scale.double().max() / 2 + 4 * FP32_EPS * abs(value)
    assert float((x_hat - x.double()).abs().max()) <= bound


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected(bad):
    x = torch.randn(2, 64)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_groups(x, 4, 64)


def test_fp16_range_rejected():
    with pytest.raises(ValueError, match="fp16 range"):
        quantize_groups(torch.full((1, 64), 1e6), 4, 64)


@pytest.mark.parametrize("bits", [1, 5, 16])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"valid: \(2, 3, 4, 8\)"):
        quantize_groups(torch.randn(1, 64), bits, 64)


def test_bad_group():
    with pytest.raises(ValueError, match="group_size=48 does not divide"):
        quantize_groups(torch.randn(1, 64), 4, 48)


@pytest.mark.parametrize("bits,floor_db", [(8, 44.0), (4, 19.0), (3, 13.0), (2, 5.5)])
def test_sqnr_floor_gaussian(bits, floor_db):
    # observed (seed 0, 2026-11-29): 8 bit 45.5 dB, 4 bit 20.9 dB, 3 bit 14.3 dB, 2 bit 6.9 dB
    x = torch.randn(512, 512, dtype=torch.float32)
    x_hat = quantize_groups(x, bits, 64).dequantize()
    sqnr = 10 * torch.log10(x.pow(2).sum() / (x - x_hat).pow(2).sum())
    assert sqnr > floor_db, float(sqnr)


def test_matches_float64_reference_formula():
    x = torch.randn(3, 128, dtype=torch.float64)
    q = quantize_groups(x, 4, 64)
    s = q.scale.double().unsqueeze(-1)
    m = q.minimum.double().unsqueeze(-1)
    ref_codes = torch.clamp(torch.round((x.view(3, 2, 64) - m) / s), 0, 15)
    # a code may differ from the float64 formula only at an exact rounding tie
    diff = (ref_codes.view(3, 128) - q.codes.double()).abs()
    assert diff.max() <= 1 and (diff > 0).sum() <= 2
    ref = dequantize_groups(ref_codes.view(3, 128), q.scale, q.minimum, 64, torch.float64)
    assert torch.allclose(ref, q.dequantize(torch.float64), atol=float(s.max()))


def test_unchecked_quantisation_reads_nothing_back(monkeypatch):
    """``check=False`` (the cache's decode steps) must not read values to the host (a GPU sync)."""
    x = torch.randn(3, 128)
    want = quantize_groups(x, 4, 64)

    def sync(*args, **kwargs):
        raise AssertionError("a host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    got = quantize_groups(x, 4, 64, check=False)
    monkeypatch.undo()
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
    with pytest.raises(ValueError, match=r"\|x\| reaches 1e\+06"):
        quantize_groups(torch.full((1, 64), 1e6), 4, 64)
