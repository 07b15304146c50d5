"""Bit allocation over the RoPE key's 2-D frequency blocks (Block-GTQ's allocator, on the affine quantiser).

Under RoPE a key's contribution to a future logit is a sum over its frequency pairs, each rotated by a
position-dependent angle: a block's quantisation error reaches the logit in proportion to its energy.
Block-GTQ scores each block without labels (here: the mean squared norm of the block over calibration
tokens, ``E||k_i||^2``), models a ``b``-bit quantiser's error as ``score_i * 4**-b`` and, starting from the
lowest width, gives one bit at a time to the block with the largest drop in modelled error until the
budget is spent. The modelled error is separable and convex in each width, so the greedy allocation is
optimal for it (a test checks this against exhaustive search).

The result is one width per pair; :func:`quantmla.quant.mixed.pair_channel_bits` turns it into the
per-channel widths of an ``m``-format RoPE path (``c4rm...``). Seed departure: Block-GTQ allocates per KV
head on TurboQuant-MSE (a random rotation and a Lloyd-Max codebook); an MLA layer has one shared RoPE key,
and here the widths apply to the per-token affine groups quantmla stores (see the issue 18 notes).
"""

from __future__ import annotations

import heapq

import torch

from quantmla.quant.mixed import MIXED_BITS


def block_energy(keys: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``[P]`` float64: the mean squared norm of each 2-D block ``pairs [P, 2]`` over ``keys [..., d]``."""
    k = keys.double().reshape(-1, keys.shape[-1])
    return k[:, pairs].pow(2).sum(-1).mean(0)


def greedy_allocation(scores: torch.Tensor, total_bits: int, min_bits: int = 0, max_bits: int = 8) -> tuple[int, ...]:
    """Integer widths per block summing to ``total_bits`` that minimise ``sum(scores_i * 4**-b_i)`` within
    ``[min_bits, max_bits]``: one bit at a time to the largest marginal gain (ties to the lower index)."""
    n = scores.numel()
    if min_bits not in MIXED_BITS or max_bits not in MIXED_BITS or min_bits > max_bits:
        raise ValueError(f"widths [{min_bits}, {max_bits}] must lie within {MIXED_BITS[0]}..{MIXED_BITS[-1]}")
    if not n * min_bits <= total_bits <= n * max_bits:
        raise ValueError(f"total_bits={total_bits} cannot be spread over {n} blocks at {min_bits}..{max_bits} bits")
    if bool((scores < 0).any()) or not bool(torch.isfinite(scores).all()):
        raise ValueError("block scores must be finite and non-negative")
    s = scores.double().tolist()
    bits = [min_bits] * n
    heap = [(-(si * 4.0**-min_bits * 0.75), i) for i, si in enumerate(s)] if min_bits < max_bits else []
    heapq.heapify(heap)
    for _ in range(total_bits - n * min_bits):
        _, i = heapq.heappop(heap)
        bits[i] += 1
        if bits[i] < max_bits:  # next bit's gain: s * (4**-b - 4**-(b+1)) = 0.75 * s * 4**-b
            heapq.heappush(heap, (-(s[i] * 4.0 ** -bits[i] * 0.75), i))
    return tuple(bits)


def modelled_error(scores: torch.Tensor, bits: tuple[int, ...]) -> float:
    """``sum(scores_i * 4**-b_i)``: the objective :func:`greedy_allocation` minimises."""
    return float(sum(float(s) * 4.0**-b for s, b in zip(scores.tolist(), bits, strict=True)))
