"""Affine groups with learned ranges (RoLaQ's quantiser): a threshold ratio and a reconstruction gain per group.

Per token and group of ``g`` channels, with ``lo``, ``hi`` the group's range, ``mid = (lo + hi) / 2`` and
``half = (hi - lo) / 2``, a group position ``j`` of the path has a learned threshold ratio ``alpha_j`` in
(0, 1] and a reconstruction gain ``gamma_j`` > 0:

    lo' = mid - alpha_j half,   step = 2 alpha_j half / (2**b - 1),
    code = clamp(round((x - lo') / step), 0, 2**b - 1),
    x_hat = mid + gamma_j (lo' + code step - mid).

The threshold shrinks the grid onto the bulk of the group (values beyond it clip); the gain scales what is
read back about the group's centre, so threshold and gain act together on the signal that both the key and
the value read (RoLaQ couples them for that reason; here both are learned against the same objective). The
stored values are the plain affine format's: codes, fp16 ``scale = gamma_j step`` and fp16 ``minimum = mid
- gamma_j alpha_j half`` (both rounded to nearest), so the kernels and the storage are unchanged and ``alpha``,
``gamma`` are per-layer constants used only when a token is written: ``bits + 32 / g`` bits per element.
``alpha = gamma = 1`` is the plain quantiser up to the fp16 rounding of the scale and minimum.
"""

from __future__ import annotations

import torch

from quantmla.quant.affine import GroupQuantized, check_bits, check_group, check_quantizable


def check_ranges(clip_ratio: torch.Tensor, gain: torch.Tensor, groups: int) -> None:
    if clip_ratio.shape != (groups,) or gain.shape != (groups,):
        raise ValueError(
            f"learned ranges: threshold ratios {tuple(clip_ratio.shape)} and gains {tuple(gain.shape)}; "
            f"expected one of each per group ({groups},)"
        )
    if not bool(((clip_ratio > 0) & (clip_ratio <= 1)).all()) or not bool((gain > 0).all()):
        raise ValueError("learned ranges: threshold ratios must lie in (0, 1] and gains be positive")


def _grid(x: torch.Tensor, bits: int, group_size: int, clip_ratio: torch.Tensor):
    """``xf [..., G, g]`` float32 and, per group, ``mid``, ``half``, ``lo'`` and the step."""
    d = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    a = clip_ratio.to(xf.device, xf.dtype).unsqueeze(-1)
    lo_c = mid - a * half
    step = 2 * a * half / ((1 << bits) - 1)
    return xf, mid, half, lo_c, step


def quantize_ranged(
    x: torch.Tensor, bits: int, group_size: int, clip_ratio: torch.Tensor, gain: torch.Tensor, check: bool = True
) -> GroupQuantized:
    """Quantise the last dimension of ``x`` in groups with learned threshold ratios and gains (one per group)."""
    check_bits(bits)
    check_group(x.shape[-1], group_size)
    check_ranges(clip_ratio, gain, x.shape[-1] // group_size)
    if check:
        check_quantizable(x, "x")
    xf, mid, half, lo_c, step = _grid(x, bits, group_size, clip_ratio)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((xf - lo_c) / safe).clamp_(0, (1 << bits) - 1)
    codes = torch.where(step > 0, codes, torch.zeros_like(codes))
    gam = gain.to(xf.device, xf.dtype).unsqueeze(-1)
    scale = (gam * step).squeeze(-1).to(torch.float16)
    minimum = (mid + gam * (lo_c - mid)).squeeze(-1).to(torch.float16)
    return GroupQuantized(codes.to(torch.uint8).reshape(x.shape), scale, minimum, bits, group_size)


def ste_ranged(
    x: torch.Tensor, bits: int, group_size: int, clip_ratio: torch.Tensor, gain: torch.Tensor
) -> torch.Tensor:
    """The read-back of :func:`quantize_ranged` without the fp16 rounding of scale and minimum, differentiable
    in ``x``, ``clip_ratio`` and ``gain`` (straight-through rounding; clipped values pass no gradient to ``x``,
    as in learned-step quantisers). For learning the ranges; the cache stores :func:`quantize_ranged`."""
    xf, mid, half, lo_c, step = _grid(x, bits, group_size, clip_ratio)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    u = ((xf - lo_c) / safe).clamp(0, (1 << bits) - 1)
    u = u + (torch.round(u) - u).detach()
    gam = gain.to(xf.device, xf.dtype).unsqueeze(-1)
    out = mid + gam * (lo_c + u * step - mid)
    return out.reshape(x.shape).to(x.dtype)
