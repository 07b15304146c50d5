"""Cache schemes: how each of the two cached paths (content latent, RoPE key) is stored.

Names: ``bf16`` (nothing quantised), ``fp8`` (content FP8 e4m3 with a power-of-two scale per 128
values, RoPE key BF16: FlashMLA's DeepSeek-V3.2 layout) and ``c<b>r<b>`` with content and RoPE
bits in {2, 3, 4, 8} (per-token asymmetric affine groups, fp16 scale and minimum per group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from quantmla.quant.affine import QUANT_BITS, quantize_groups
from quantmla.quant.fp8 import FP8_TILE, quantize_fp8

PathKind = Literal["bf16", "int", "fp8"]
_INT_RE = re.compile(r"^c(\d+)r(\d+)$")


@dataclass(frozen=True)
class PathFormat:
    """Storage of one cached path."""

    kind: PathKind
    bits: int = 16

    def __post_init__(self) -> None:
        if self.kind == "int" and self.bits not in QUANT_BITS:
            raise ValueError(f"integer path bits={self.bits} not supported; valid: {QUANT_BITS}")
        if self.kind not in ("bf16", "int", "fp8"):
            raise ValueError(f"path kind {self.kind!r} unknown; valid: bf16, int, fp8")

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    def fake_quantize(self, x: torch.Tensor, group_size: int = 64) -> torch.Tensor:
        """``x`` stored and read back in this format (per token, so it equals the cache's values)."""
        if self.kind == "bf16":
            return x
        if self.kind == "fp8":
            return quantize_fp8(x).dequantize(x.dtype)
        return quantize_groups(x, self.bits, group_size).dequantize(x.dtype)

    def bytes_per_token(self, dim: int, group_size: int, hp_bytes: int = 2) -> int:
        """Persistent bytes for one token's ``dim`` values in this format."""
        if self.kind == "bf16":
            return dim * hp_bytes
        if self.kind == "fp8":
            return dim + (dim // FP8_TILE) * 4
        return dim * self.bits // 8 + (dim // group_size) * 4  # fp16 scale + fp16 minimum


@dataclass(frozen=True)
class CacheScheme:
    name: str
    content: PathFormat
    rope: PathFormat

    @property
    def quantized(self) -> bool:
        return self.content.quantized or self.rope.quantized

    def bytes_per_token(self, kv_lora_rank: int, rope_dim: int, group_size: int = 64) -> int:
        """Persistent bytes of one quantised token (both paths)."""
        return self.content.bytes_per_token(kv_lora_rank, group_size) + self.rope.bytes_per_token(rope_dim, group_size)


def valid_scheme_names() -> list[str]:
    ints = [f"c{c}r{r}" for c in QUANT_BITS for r in QUANT_BITS]
    return ["bf16", "fp8", *ints]


def parse_scheme(name: str | CacheScheme) -> CacheScheme:
    """Parse a scheme name (case-insensitive) into a :class:`CacheScheme`."""
    if isinstance(name, CacheScheme):
        return name
    key = str(name).strip().lower()
    if key == "bf16":
        return CacheScheme("bf16", PathFormat("bf16"), PathFormat("bf16"))
    if key == "fp8":
        return CacheScheme("fp8", PathFormat("fp8", 8), PathFormat("bf16"))
    m = _INT_RE.match(key)
    if m and int(m.group(1)) in QUANT_BITS and int(m.group(2)) in QUANT_BITS:
        return CacheScheme(key, PathFormat("int", int(m.group(1))), PathFormat("int", int(m.group(2))))
    raise ValueError(
        f"unknown cache scheme {name!r}; valid: bf16, fp8, or c<b>r<b> with content and RoPE bits in "
        f"{QUANT_BITS} (e.g. c4r4, c2r4, c8r8)"
    )
