"""Per-token clipping before group quantisation (RAQ-MLA's INT2 latent: groups of 128, 0.94 quantile).

Each token's values are clamped to ``[-c, c]`` with ``c`` the ``quantile`` of ``|x|`` over the token's
channels, then quantised in per-token groups by :func:`~quantmla.quant.affine.quantize_groups`. The
metadata is that quantiser's (fp16 scale and minimum per group): ``bits + 32 / group_size`` bits per
element. Values inside ``[-c, c]`` keep the quantiser's bound ``scale / 2``; a clipped value is off by
at most ``|x| - c + scale / 2``.
"""

from __future__ import annotations

import torch

from quantmla.quant.affine import GroupQuantized, check_quantizable, quantize_groups


def check_quantile(quantile: float) -> None:
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"clipping quantile {quantile!r} must lie in (0, 1]; 1 clips nothing")


def clip_threshold(x: torch.Tensor, quantile: float) -> torch.Tensor:
    """``[..., 1]``: the ``quantile`` of ``|x|`` over the last dimension (float32, linear interpolation)."""
    check_quantile(quantile)
    return torch.quantile(x.float().abs(), quantile, dim=-1, keepdim=True)


def clip_tokens(x: torch.Tensor, quantile: float) -> torch.Tensor:
    """``x`` (float32) clamped per token to ``[-c, c]``, ``c`` = :func:`clip_threshold`."""
    if quantile == 1.0:
        return x.float()
    c = clip_threshold(x, quantile)
    return torch.minimum(torch.maximum(x.float(), -c), c)


def quantize_clipped(
    x: torch.Tensor, bits: int, group_size: int, quantile: float, check: bool = True
) -> GroupQuantized:
    """Clip each token at the ``quantile`` of its ``|x|``, then quantise in groups of ``group_size``."""
    if check:
        check_quantizable(x, "x")
    return quantize_groups(clip_tokens(x, quantile), bits, group_size, check=False)
