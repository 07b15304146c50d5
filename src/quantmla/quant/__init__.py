from quantmla.quant.affine import QUANT_BITS, GroupQuantized, dequantize_groups, fake_quantize, quantize_groups
from quantmla.quant.channel import dequantize_per_channel, quantize_per_channel
from quantmla.quant.fp8 import Fp8Quantized, dequantize_fp8, quantize_fp8
from quantmla.quant.packing import pack_codes, packed_size, unpack_codes
from quantmla.quant.scheme import CacheScheme, PathFormat, parse_scheme, valid_scheme_names

__all__ = [
    "QUANT_BITS",
    "CacheScheme",
    "Fp8Quantized",
    "GroupQuantized",
    "PathFormat",
    "dequantize_fp8",
    "dequantize_groups",
    "dequantize_per_channel",
    "fake_quantize",
    "pack_codes",
    "packed_size",
    "parse_scheme",
    "quantize_fp8",
    "quantize_groups",
    "quantize_per_channel",
    "unpack_codes",
    "valid_scheme_names",
]
