"""Block-GTQ's greedy RoPE-pair bit allocation: budget, optimality against exhaustive search, and that the
allocated widths lower the modelled and the real error of the RoPE key at equal bits."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.formats.scheme import PathFormat
from quantmla.models.adapter import RopeLayout
from quantmla.quant.allocate import block_energy, greedy_allocation, modelled_error
from quantmla.quant.mixed import pair_channel_bits


@settings(max_examples=40, deadline=None)
@given(
    scores=st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=5),
    lo=st.integers(0, 2),
    span=st.integers(0, 3),
    data=st.data(),
)
def test_greedy_is_optimal_for_the_modelled_error(scores, lo, span, data):
    hi = lo + span
    n = len(scores)
    total = data.draw(st.integers(n * lo, n * hi))
    s = torch.tensor(scores, dtype=torch.float64)
    got = greedy_allocation(s, total, lo, hi)
    assert sum(got) == total and all(lo <= b <= hi for b in got)
    best = min(
        modelled_error(s, c) for c in itertools.product(range(lo, hi + 1), repeat=n) if sum(c) == total
    )  # exhaustive
    assert modelled_error(s, got) <= best * (1 + 1e-12) + 1e-300


def test_more_energy_gets_more_bits_and_errors():
    s = torch.tensor([1.0, 100.0, 10.0, 0.1])
    bits = greedy_allocation(s, 12)
    assert bits[1] >= bits[2] >= bits[0] >= bits[3] and sum(bits) == 12
    for bad, kw in [("total_bits=40", dict(total_bits=40)), ("widths", dict(total_bits=8, max_bits=9))]:
        with pytest.raises(ValueError, match=bad):
            greedy_allocation(s, **kw)
    with pytest.raises(ValueError, match="non-negative"):
        greedy_allocation(torch.tensor([1.0, -1.0]), 4)


def test_allocation_lowers_the_logit_error_of_an_uneven_rope_key():
    """A key whose energy sits in a few pairs (as RoPE keys' low frequencies do), quantised per channel within
    pages (each channel its own range): at the same 3 bits a channel on average, the allocated widths lower
    the error of q.k over random queries against uniform 3 bits. In shared per-token groups (one range for all
    channels) every channel's error scales with that one range, not its own energy, and the allocation hurts:
    the energy model holds for per-channel ranges only."""
    g = torch.Generator().manual_seed(0)
    pairs = RopeLayout.pairs(64, interleaved=False)
    gain = torch.ones(64)
    gain[pairs[:6].flatten()] = 20.0  # six loud pairs
    keys = torch.randn(4096, 64, generator=g) * gain
    q = torch.randn(64, 256, generator=g)
    widths = greedy_allocation(block_energy(keys, pairs), 3 * 32, min_bits=1)
    channel_bits = pair_channel_bits(widths, pairs.tolist())

    def err(fmt):
        return ((fmt.fake_quantize(keys, 64) - keys) @ q).pow(2).mean()

    paged = err(PathFormat("int", channel_bits=channel_bits, page=64)), err(PathFormat("int", 3, page=64))
    assert paged[0] < 0.8 * paged[1], paged
    shared = err(PathFormat("int", channel_bits=channel_bits)), err(PathFormat("int", channel_bits=(3,) * 64))
    assert shared[0] > shared[1], shared
