"""TurboQuant-MSE and Block-GTQ's width groups: the Lloyd-Max codebook, nearest-centroid codes, the norm
kept, distortion at the Gaussian rate, BPE and storage formulas, and the cache holding it exactly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.cache.store import PathStore
from quantmla.formats.scheme import parse_scheme
from quantmla.quant.turbo import (
    codebook,
    lloyd_max_gaussian,
    quantize_turbo,
    rotation,
    width_groups,
)

SEEDS = st.integers(0, 2**31 - 1)
WIDTHS = st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6]), min_size=8, max_size=8).map(
    lambda w: tuple(b for b in w for _ in range(2))  # one width per 2-D block, as an allocation gives
)


def test_lloyd_max_centroids_are_the_conditional_means_of_their_cells():
    # the published values, then the fixed-point condition by trapezoid integration (independent of the
    # closed form the implementation uses)
    assert lloyd_max_gaussian(1)[1] == pytest.approx(math.sqrt(2 / math.pi), abs=1e-12)
    assert lloyd_max_gaussian(2)[2:] == pytest.approx((0.4528, 1.5104), abs=1e-4)
    for bits in (2, 3, 4):
        c = torch.tensor(lloyd_max_gaussian(bits), dtype=torch.float64)
        edges = [-12.0, *((c[:-1] + c[1:]) / 2).tolist(), 12.0]
        for i in range(len(c)):
            t = torch.linspace(edges[i], edges[i + 1], 200_001, dtype=torch.float64)
            pdf = torch.exp(-t * t / 2)
            mean = torch.trapezoid(t * pdf, t) / torch.trapezoid(pdf, t)
            assert abs(mean.item() - c[i].item()) < 1e-8


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, widths=WIDTHS)
def test_codes_are_the_nearest_centroids_and_the_norm_is_kept(seed, widths):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 16, generator=g) * torch.rand(6, 1, generator=g) * 20
    q = quantize_turbo(x, widths)
    x_hat = q.dequantize(torch.float64)
    for b, idx in width_groups(widths):
        v = x[:, idx].double()
        y = v / v.norm(dim=-1, keepdim=True) @ rotation(len(idx), b, dtype=torch.float64)
        cb = codebook(b, len(idx), dtype=torch.float64)
        nearest = (y[..., None] - cb).abs().argmin(-1)
        assert torch.equal(q.codes[:, idx].long(), nearest)  # the error bound: min over the codebook
        # the corrected norm keeps the group's norm (up to the fp16 it is stored in)
        ratio = x_hat[:, idx].norm(dim=-1) / v.norm(dim=-1)
        assert ((ratio - 1).abs() <= 2**-10).all()
    zero = [i for i, b in enumerate(widths) if b == 0]
    assert (x_hat[:, zero] == 0).all()  # a zero width stores nothing and reads 0


@pytest.mark.parametrize("bits,rate", [(2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_distortion_is_the_gaussian_lloyd_max_rate(bits, rate):
    # after the random rotation a unit vector's coordinates are ~N(0, 1/d): the relative MSE approaches the
    # scalar Lloyd-Max distortion of N(0, 1) (Max 1960) for any input distribution, outliers included
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4000, 64, generator=g)
    x[:, ::9] *= 15
    x_hat = quantize_turbo(x, (bits,) * 64).dequantize()
    rel = ((x - x_hat) ** 2).sum(-1).mean() / (x**2).sum(-1).mean()
    assert abs(rel.item() / rate - 1) < 0.1


@pytest.mark.parametrize(
    "name,dim", [("c4r3t", 64), ("c4rm4x16-3x32-2x16t", 64), ("c2tr4", 512), ("c4rm0x8-4x56t", 64)]
)
def test_bpe_and_storage_follow_the_formula(name, dim):
    s = parse_scheme(name)
    fmt = s.rope if name.startswith("c4r") else s.content
    widths = fmt.widths(dim)
    groups = len({b for b in widths if b})
    formula = math.ceil(sum(widths) / 8) + 2 * groups
    assert fmt.bytes_per_token(dim, 64) == formula
    assert fmt.bits_per_element(dim, 64) == pytest.approx(8 * formula / dim)
    store = PathStore(fmt, dim, 64, batch=3, hp_dtype=torch.float32, device=torch.device("cpu"), page_size=8)
    x = torch.randn(3, 8, dim)
    store.append(x)
    assert store.nbytes() == 3 * 8 * formula  # one whole page of 8 tokens
    assert torch.equal(store.dequantize(torch.float32), fmt.fake_quantize(x))


def test_rotation_is_orthogonal_and_fixed():
    r = rotation(32, 3, dtype=torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(32, dtype=torch.float64), atol=1e-12)
    assert torch.equal(r, rotation(32, 3, dtype=torch.float64))
    assert not torch.equal(r, rotation(32, 4, dtype=torch.float64))


@pytest.mark.parametrize("bad", ["c4r3g32t", "c4r7t", "c4rm8x32-2x32t", "c4r4p64t", "c4r4q90t"])
def test_tq_mse_takes_no_affine_options(bad):
    with pytest.raises(ValueError, match="TQ-MSE"):
        parse_scheme(bad)


def test_non_finite_values_are_refused():
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_turbo(x, (3,) * 16)
