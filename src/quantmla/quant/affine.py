"""Per-token asymmetric affine group quantiser (METHOD.md section 5).

Each group of ``group_size`` consecutive channels of one token gets its own scale and minimum,
both stored in fp16:

    scale = (max - min) / (2**b - 1),  code = clamp(round((x - min) / scale), 0, 2**b - 1),
    x_hat = code * scale + min.

The stored fp16 minimum is rounded *down* and the fp16 scale *up*, so the fp16 grid still covers
``[min, max]`` of the group and every element keeps the bound ``|x - x_hat| <= scale / 2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_BITS = (2, 3, 4, 8)
FP16_MAX = 65504.0


def check_bits(bits: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits={bits!r} is not supported; valid: {QUANT_BITS}")


def check_group(dim: int, group_size: int) -> None:
    if group_size <= 0 or dim % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the channel dimension {dim}; "
            f"valid group sizes are the divisors of {dim}"
        )


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise if ``x`` holds NaN or infinities (reads a flag back to the host: a GPU sync)."""
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{what} holds {bad} NaN or infinite value(s); quantisation needs finite values")


def check_quantizable(x: torch.Tensor, what: str = "input") -> None:
    """Raise unless ``x`` is finite and inside the fp16 range of the stored scale and minimum. This
    reads values back to the host (GPU syncs), so callers on a hot path check once at a boundary."""
    check_finite(x, what)
    amax = x.abs().max().item() if x.numel() else 0.0
    if amax > FP16_MAX:
        raise ValueError(f"|{what}| reaches {amax:g}, beyond the fp16 range ({FP16_MAX}) of the stored scale/min")


def fp16_round(x: torch.Tensor, direction: float) -> torch.Tensor:
    """Round ``x`` (float64, so tiny quotients do not underflow) to fp16 towards ``direction``."""
    y = x.to(torch.float16)
    off = (y.double() > x) if direction < 0 else (y.double() < x)
    target = torch.full_like(y, direction)
    return torch.where(off, torch.nextafter(y, target), y)


@dataclass(frozen=True)
class GroupQuantized:
    """Unpacked result of :func:`quantize_groups`; ``codes`` is uint8 with the input's shape."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_groups(self.codes, self.scale, self.minimum, self.group_size, dtype)


def quantize_groups(x: torch.Tensor, bits: int, group_size: int = 64, check: bool = True) -> GroupQuantized:
    """Quantise the last dimension of ``x`` in groups of ``group_size`` channels. ``check``: first
    :func:`check_quantizable` (GPU syncs; pass ``False`` where the values were checked before)."""
    check_bits(bits)
    d = x.shape[-1]
    check_group(d, group_size)
    if check:
        check_quantizable(x, "x")
    xf = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo = xf.amin(-1)
    hi = xf.amax(-1)
    minimum = fp16_round(lo.double(), float("-inf")).clamp_min(-FP16_MAX)
    qmax = (1 << bits) - 1
    scale = fp16_round((hi.double() - minimum.double()) / qmax, float("inf"))
    s = scale.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((xf - minimum.float().unsqueeze(-1)) / safe).clamp_(0, qmax)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    return GroupQuantized(codes.to(torch.uint8).reshape(x.shape), scale, minimum, bits, group_size)


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    d = codes.shape[-1]
    c = codes.float().reshape(*codes.shape[:-1], d // group_size, group_size)
    x = c * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int = 64) -> torch.Tensor:
    """Quantise then dequantise, returning ``x``'s dtype (no finiteness check: for inner loops)."""
    return quantize_groups(x, bits, group_size, check=False).dequantize(x.dtype)
