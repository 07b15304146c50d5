"""RoLaQ's learned-range quantiser: plain affine storage, the grid on the shrunk range, the gain about the centre."""

import pytest
import torch

from quantmla.formats.scheme import parse_scheme
from quantmla.quant.affine import quantize_groups
from quantmla.quant.ranged import quantize_ranged, ste_ranged


def _x(seed=0, shape=(3, 50, 128)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.linspace(0.2, 3, shape[-1])


def _fp16_tol(mid, half, step, qmax):
    """What the nearest-fp16 scale and minimum may move a read-back value by."""
    return 2.0**-10 * (mid.abs() + half + qmax * step) + 1e-6


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unit_ranges_are_the_plain_quantiser(bits):
    x = _x()
    ones = torch.ones(2)
    q = quantize_ranged(x, bits, 64, ones, ones)
    plain = quantize_groups(x, bits, 64)
    xg = x.reshape(3, 50, 2, 64)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    qmax = (1 << bits) - 1
    step = (hi - lo) / qmax
    err = (q.dequantize().reshape(xg.shape) - xg).abs()
    assert (err <= step / 2 + _fp16_tol((lo + hi) / 2, (hi - lo) / 2, step, qmax)).all()
    # the same codes but where the fp16 rounding of the plain grid moves a value across a boundary
    assert (q.codes == plain.codes).float().mean() > 0.99


@pytest.mark.parametrize("seed", range(5))
def test_error_bound_inside_the_threshold_and_clipping_outside(seed):
    g = torch.Generator().manual_seed(seed)
    x = _x(seed)
    alpha = torch.rand(2, generator=g) * 0.5 + 0.5
    one = torch.ones(2)
    q = quantize_ranged(x, 3, 64, alpha, one)
    xh = q.dequantize().reshape(3, 50, 2, 64)
    xg = x.reshape(3, 50, 2, 64)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    a = alpha.view(2, 1)
    lo_c, hi_c = mid - a * half, mid + a * half
    step = (hi_c - lo_c) / 7
    inside = (xg >= lo_c) & (xg <= hi_c)
    tol = step / 2 + _fp16_tol(mid, half, step, 7)
    assert ((xh - xg).abs() <= tol)[inside].all()
    # outside the threshold a value reads as the nearest end of the grid
    assert ((xh - torch.minimum(torch.maximum(xg, lo_c), hi_c)).abs() <= tol)[~inside].all()
    assert (~inside).any()


def test_gain_scales_about_the_centre_and_storage_is_affine():
    x = _x(1)
    one, gam = torch.ones(2), torch.tensor([0.8, 1.2])
    base = quantize_ranged(x, 2, 64, one, one)
    scaled = quantize_ranged(x, 2, 64, one, gam)
    assert torch.equal(base.codes, scaled.codes)  # the gain changes the read-back only
    xg = x.reshape(3, 50, 2, 64)
    mid = (xg.amin(-1, keepdim=True) + xg.amax(-1, keepdim=True)) / 2
    want = mid + gam.view(2, 1) * (base.dequantize().reshape(3, 50, 2, 64) - mid)
    got = scaled.dequantize().reshape(3, 50, 2, 64)
    assert (got - want).abs().max() <= 2e-3 * xg.abs().max()
    # storage: the plain affine format's codes, one fp16 scale and minimum a group
    assert scaled.scale.dtype == scaled.minimum.dtype == torch.float16 and scaled.scale.shape == (3, 50, 2)
    assert parse_scheme("c2r4").content.bits_per_element(128, 64) == 2 + 32 / 64


def test_ste_matches_the_stored_read_back_and_has_gradients():
    x = _x(2).double()
    alpha = torch.tensor([0.9, 0.7], dtype=torch.float64, requires_grad=True)
    gam = torch.tensor([1.1, 0.95], dtype=torch.float64, requires_grad=True)
    y = ste_ranged(x, 2, 64, alpha, gam)
    stored = quantize_ranged(x, 2, 64, alpha.detach(), gam.detach()).dequantize(torch.float64)
    assert (y - stored).abs().max() <= 2e-3 * x.abs().max()
    (y - x).pow(2).sum().backward()
    assert alpha.grad.abs().min() > 0 and gam.grad.abs().min() > 0


def test_bad_ranges_are_refused():
    x = _x()
    with pytest.raises(ValueError, match="one of each per group"):
        quantize_ranged(x, 2, 64, torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        quantize_ranged(x, 2, 64, torch.tensor([1.5, 1.0]), torch.ones(2))
