"""Numerical quantisers: the arithmetic of each format (affine groups, per-channel pages, clipping, FP8,
mixed widths, learned ranges, TQ-MSE), with no notion of how a cache stores it (:mod:`quantmla.formats`)."""

from quantmla.quant.affine import QUANT_BITS, GroupQuantized, dequantize_groups, fake_quantize, quantize_groups
from quantmla.quant.channel import dequantize_per_channel, quantize_per_channel
from quantmla.quant.fp8 import Fp8Quantized, dequantize_fp8, quantize_fp8

__all__ = [
    "QUANT_BITS",
    "Fp8Quantized",
    "GroupQuantized",
    "dequantize_fp8",
    "dequantize_groups",
    "dequantize_per_channel",
    "fake_quantize",
    "quantize_fp8",
    "quantize_groups",
    "quantize_per_channel",
]
