"""FP8 e4m3 with a power-of-two scale per tile of 128 values.

This mirrors the layout FlashMLA uses for DeepSeek-V3.2's cache (512 content values as FP8 with
four float32 power-of-two scales, the 64-dim RoPE key in BF16: 656 bytes per token). It is the
production FP8 reference that the low-bit schemes are compared against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.quant.affine import check_finite, check_group

FP8_TILE = 128
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Quantized:
    values: torch.Tensor  # float8_e4m3fn, input's shape
    scale: torch.Tensor  # float32, one power of two per tile
    tile: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.values, self.scale, self.tile, dtype)


def quantize_fp8(x: torch.Tensor, tile: int = FP8_TILE, check: bool = True) -> Fp8Quantized:
    d = x.shape[-1]
    check_group(d, tile)
    if check:
        check_finite(x)
    xf = x.float().reshape(*x.shape[:-1], d // tile, tile)
    amax = xf.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Quantized(q.reshape(x.shape), scale, tile)


def dequantize_fp8(
    values: torch.Tensor, scale: torch.Tensor, tile: int = FP8_TILE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    d = values.shape[-1]
    v = values.float().reshape(*values.shape[:-1], d // tile, tile) * scale.unsqueeze(-1)
    return v.reshape(values.shape).to(dtype)
