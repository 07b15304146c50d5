"""Per-channel-within-page quantiser (KIVI / RAQ-MLA style keys).

Keys have outlier *channels* rather than outlier tokens, so KIVI and RAQ-MLA quantise each channel
over a page of consecutive tokens: one fp16 scale and minimum per (page, channel). This is the
transpose of :func:`quantize_groups`: the group runs along the token axis.
"""

from __future__ import annotations

import torch

from quantmla.quant.affine import GroupQuantized, dequantize_groups, quantize_groups


def quantize_per_channel(x: torch.Tensor, bits: int, page_size: int = 64, check: bool = True) -> GroupQuantized:
    """Quantise ``x`` of shape ``[..., tokens, channels]`` with one group per channel per page.

    The returned ``codes`` have ``x``'s shape; ``scale``/``minimum`` have shape
    ``[..., tokens // page_size, channels]``.
    """
    if x.dim() < 2:
        raise ValueError(f"per-channel quantisation needs [..., tokens, channels], got shape {tuple(x.shape)}")
    t = x.shape[-2]
    if page_size <= 0 or t % page_size:
        raise ValueError(f"page_size={page_size} must divide the number of tokens {t}")
    xt = x.transpose(-1, -2)  # [..., channels, tokens]: groups of page_size tokens per channel
    q = quantize_groups(xt, bits, page_size, check=check)
    return GroupQuantized(
        codes=q.codes.transpose(-1, -2),
        scale=q.scale.transpose(-1, -2),
        minimum=q.minimum.transpose(-1, -2),
        bits=bits,
        group_size=page_size,
    )


def dequantize_per_channel(q: GroupQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = q.codes.transpose(-1, -2)
    x = dequantize_groups(codes, q.scale.transpose(-1, -2), q.minimum.transpose(-1, -2), q.group_size, dtype)
    return x.transpose(-1, -2)
