"""Mixed bit widths within a per-token group: an integer width per channel (per RoPE frequency pair).

Block-GTQ allocates bits to the RoPE key's 2-D frequency blocks; here each channel ``i`` gets ``bits[i]``
bits (both channels of a pair the same), and a group of ``group_size`` channels of one token shares one
range, stored as its fp16 minimum (rounded down) and fp16 span ``max - min`` (rounded up). Channel ``i``
reads the range on its own grid, ``scale_i = span / (2**bits[i] - 1)``:

    code_i = clamp(round((x_i - min) / scale_i), 0, 2**bits[i] - 1),  x_hat_i = code_i * scale_i + min,

so ``|x_i - x_hat_i| <= scale_i / 2`` and the metadata is that of the uniform quantiser (32 bits a group).
Codes are stored as one little-endian bit stream per token, channel after channel, padded to a byte
(:func:`quantmla.formats.packing.pack_mixed`): ``ceil(sum(bits) / 8)`` bytes plus 4 a group. A zero width
stores nothing: the channel reads as ``min``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.quant.affine import FP16_MAX, check_group, check_quantizable, fp16_round

MIXED_BITS = (0, 1, 2, 3, 4, 5, 6, 7, 8)


def check_channel_bits(bits: tuple[int, ...], dim: int) -> None:
    if len(bits) != dim:
        raise ValueError(f"{len(bits)} channel bit widths for a path of {dim} channels")
    bad = sorted({b for b in bits if b not in MIXED_BITS})
    if bad:
        raise ValueError(f"channel bit widths {bad} not supported; valid: {MIXED_BITS}")


def pair_channel_bits(pair_bits: tuple[int, ...], pairs: list[tuple[int, int]]) -> tuple[int, ...]:
    """Per-channel widths from one width per 2-D block ``pairs[k] = (i, j)`` (the model's RoPE pairs)."""
    if len(pair_bits) != len(pairs):
        raise ValueError(f"{len(pair_bits)} pair bit widths for {len(pairs)} RoPE pairs")
    out = [0] * (2 * len(pairs))
    for b, (i, j) in zip(pair_bits, pairs, strict=True):
        out[i] = out[j] = int(b)
    return tuple(out)


@dataclass(frozen=True)
class MixedQuantized:
    """Unpacked codes (uint8, ``x``'s shape), fp16 ``minimum`` and ``span`` per group."""

    codes: torch.Tensor
    minimum: torch.Tensor
    span: torch.Tensor
    bits: tuple[int, ...]
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mixed(self.codes, self.minimum, self.span, self.bits, self.group_size, dtype)


def _levels(bits: tuple[int, ...], device) -> torch.Tensor:
    return torch.tensor([(1 << b) - 1 for b in bits], dtype=torch.float32, device=device)


def quantize_mixed(x: torch.Tensor, bits: tuple[int, ...], group_size: int, check: bool = True) -> MixedQuantized:
    """Quantise the last dimension of ``x`` with ``bits[i]`` bits for channel ``i``, groups of ``group_size``."""
    d = x.shape[-1]
    check_channel_bits(bits, d)
    check_group(d, group_size)
    if check:
        check_quantizable(x, "x")
    xf = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    levels = _levels(bits, x.device).reshape(d // group_size, group_size)
    codes, minimum, span = _encode(xf, levels, -1)
    return MixedQuantized(codes.to(torch.uint8).reshape(x.shape), minimum, span, tuple(bits), group_size)


def dequantize_mixed(codes, minimum, span, bits, group_size, dtype=torch.float32) -> torch.Tensor:
    d = codes.shape[-1]
    levels = _levels(bits, codes.device).reshape(d // group_size, group_size)
    c = codes.float().reshape(*codes.shape[:-1], d // group_size, group_size)
    return _decode(c, minimum, span, levels, -1).reshape(codes.shape).to(dtype)


def _encode(xf: torch.Tensor, levels: torch.Tensor, axis: int):
    """Codes, fp16 minimum and span of ``xf`` with the range taken along ``axis`` and a channel's step
    ``span / levels`` (``levels`` broadcasts against ``xf``)."""
    minimum = fp16_round(xf.amin(axis).double(), float("-inf")).clamp_min(-FP16_MAX)
    span = fp16_round(xf.amax(axis).double() - minimum.double(), float("inf"))
    scale = span.float().unsqueeze(axis) / levels.clamp_min(1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((xf - minimum.float().unsqueeze(axis)) / safe)
    codes = torch.minimum(codes.clamp_min_(0), levels).masked_fill_(scale <= 0, 0)
    return codes, minimum, span


def _decode(c: torch.Tensor, minimum, span, levels: torch.Tensor, axis: int) -> torch.Tensor:
    return c * (span.float().unsqueeze(axis) / levels.clamp_min(1)) + minimum.float().unsqueeze(axis)


def quantize_channels_mixed(x: torch.Tensor, bits: tuple[int, ...], page: int, check: bool = True) -> MixedQuantized:
    """Per channel within pages (the layout of :mod:`~quantmla.quant.channel`) with a width per channel:
    ``x [..., tokens, d]``, each channel of each page of ``page`` tokens its own fp16 minimum and span
    (``[..., tokens / page, d]``). Here a channel's error scales with its own range, which is what an energy
    allocation (:mod:`~quantmla.quant.allocate`) assumes."""
    t, d = x.shape[-2], x.shape[-1]
    check_channel_bits(bits, d)
    if page <= 0 or t % page:
        raise ValueError(f"page={page} must divide the number of tokens {t}")
    if check:
        check_quantizable(x, "x")
    xf = x.float().reshape(*x.shape[:-2], t // page, page, d)
    codes, minimum, span = _encode(xf, _levels(bits, x.device), -2)
    return MixedQuantized(codes.to(torch.uint8).reshape(x.shape), minimum, span, tuple(bits), page)


def dequantize_channels_mixed(codes, minimum, span, bits, page, dtype=torch.float32) -> torch.Tensor:
    t, d = codes.shape[-2], codes.shape[-1]
    c = codes.float().reshape(*codes.shape[:-2], t // page, page, d)
    return _decode(c, minimum, span, _levels(bits, codes.device), -2).reshape(codes.shape).to(dtype)
