"""One cached path of one token in bytes: the single definition of what the cache, the decode kernels' pages
and an engine's records store for the content latent or the RoPE key.

A :class:`PathLayout` is a path's format (:class:`~quantmla.formats.scheme.PathFormat`, any per-token format:
not ``p<P>``, whose metadata belongs to a page of tokens), its channel count and group. Its fields, in order,
with their bytes a token (``d`` channels, ``g`` the path's group):

* ``bf16`` (unquantised): ``values`` (``d`` values of ``hp_dtype``: BF16 in records and pages, the model's dtype
  in :class:`~quantmla.cache.QuantizedLatentCache`'s windows);
* ``fp8``: ``fp8`` (``d``) e4m3 values, then ``fp8_scale`` (``4 d / 128``), a float32 power of two per 128;
* integer, per-token affine groups (clipped and learned-range formats store the same): ``codes`` (``d b / 8``;
  group-planar words at 2 and 4 bits (:func:`~quantmla.formats.packing.pack_words`, the content latent's words
  of :data:`~quantmla.formats.packing.CONTENT_PLANES` codes, the RoPE key's of
  :data:`~quantmla.formats.packing.ROPE_PLANES`), one byte a code at 8 bits, the bit stream at 3), then ``sm``
  (``4 d / g``), per group the fp16 (scale, minimum) pair;
* mixed widths: ``codes`` (one bit stream, :func:`~quantmla.formats.packing.pack_mixed`), then ``sm`` (``4 d / g``),
  per group the fp16 (span, minimum) pair;
* TQ-MSE: ``codes`` (one bit stream), then ``norms`` (2 bytes per width group), fp16.

:meth:`PathLayout.encode` quantises tokens into those fields (uint8, ``[..., nbytes]`` each) and
:meth:`PathLayout.decode` reads them back: the values equal the format's quantise-then-dequantise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from quantmla.formats.packing import (
    pack_codes,
    pack_mixed,
    pack_words,
    packed_bytes,
    planes_of,
    unpack_codes,
    unpack_mixed,
    unpack_planar,
)
from quantmla.quant.affine import check_group, dequantize_groups, quantize_groups
from quantmla.quant.clip import quantize_clipped
from quantmla.quant.fp8 import FP8_TILE, dequantize_fp8, quantize_fp8
from quantmla.quant.mixed import dequantize_mixed, quantize_mixed
from quantmla.quant.ranged import check_ranges, quantize_ranged
from quantmla.quant.turbo import dequantize_turbo, quantize_turbo, width_groups

if TYPE_CHECKING:
    from quantmla.formats.scheme import PathFormat

#: the integer widths held as group-planar words (the kernels' layout)
PLANAR_BITS = (2, 4)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` (any dtype) as its bytes ``[..., n * itemsize]`` (uint8)."""
    return x.contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[..., n]`` (uint8, possibly a strided view) as ``dtype`` values ``[..., n / itemsize]``: a view
    where the bytes' strides and offset allow it, else a copy."""
    if b.stride(-1) == 1:
        try:
            return b.view(dtype)
        except RuntimeError:  # an offset or stride not a multiple of the item size
            pass
    return b.contiguous().view(dtype)


@dataclass(frozen=True)
class PathLayout:
    """The stored fields of one path: ``fmt`` over ``dim`` channels, ``group_size`` the cache's group (the
    format's own ``g<n>`` wins), ``path`` ``"c"`` (content latent) or ``"r"`` (RoPE key), which sets the
    group-planar planes; ``hp_dtype`` the dtype of an unquantised path's values."""

    fmt: PathFormat
    dim: int
    group_size: int = 64
    path: str = "c"
    hp_dtype: torch.dtype = torch.bfloat16
    fields: tuple[tuple[str, int], ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        fmt, d = self.fmt, self.dim
        if fmt.page is not None:
            raise ValueError(f"the per-channel-in-page format '{self.path}{fmt.spec}' has no per-token record")
        planes_of(self.path)
        object.__setattr__(self, "group_size", fmt.group_size(self.group_size))
        g = self.group_size
        if fmt.kind == "bf16":
            fields = [("values", d * self.hp_dtype.itemsize)]
        elif fmt.kind == "fp8":
            check_group(d, FP8_TILE)
            fields = [("fp8", d), ("fp8_scale", 4 * (d // FP8_TILE))]
        elif fmt.turbo:
            bits = fmt.widths(d)
            fields = [("codes", packed_bytes(bits)), ("norms", 2 * len(width_groups(bits)))]
        else:
            check_group(d, g)
            if fmt.channel_bits is not None:
                if len(fmt.channel_bits) != d:
                    raise ValueError(f"{len(fmt.channel_bits)} channel widths for a path of {d} channels")
                codes = packed_bytes(fmt.channel_bits)
            elif fmt.bits in PLANAR_BITS:
                if d % planes_of(self.path):
                    raise ValueError(f"{d} channels do not split into {planes_of(self.path)} group-planar runs")
                codes = d * fmt.bits // 8
            else:
                if d % 8:
                    raise ValueError(f"{fmt.bits}-bit codes of {d} channels: the channel count must be a multiple of 8")
                codes = d * fmt.bits // 8
            fields = [("codes", codes), ("sm", 4 * (d // g))]
        object.__setattr__(self, "fields", tuple(fields))

    @property
    def nbytes(self) -> int:
        """Bytes of one token's path (the fields back to back)."""
        return sum(n for _, n in self.fields)

    @property
    def planar(self) -> bool:
        """Whether the codes are group-planar words (plain integer groups of 2 or 4 bits)."""
        f = self.fmt
        return f.kind == "int" and not f.turbo and f.channel_bits is None and f.bits in PLANAR_BITS

    @property
    def planes(self) -> int:
        return planes_of(self.path)

    def encode(
        self, x: torch.Tensor, check: bool = False, ranges: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The fields (uint8 ``[..., nbytes]`` each, in order) of tokens ``x [..., dim]``, quantised once.
        ``ranges``: learned threshold ratios and gains per group (:mod:`~quantmla.quant.ranged`), for a plain
        affine format. ``check``: reject values the format cannot hold (a GPU sync)."""
        fmt, g = self.fmt, self.group_size
        if fmt.kind == "bf16":
            return [as_bytes(x.to(self.hp_dtype))]
        if fmt.kind == "fp8":
            q = quantize_fp8(x, check=check)
            return [as_bytes(q.values), as_bytes(q.scale.float())]
        if fmt.turbo:
            t = quantize_turbo(x, fmt.widths(self.dim), check=check)
            return [pack_mixed(t.codes, t.channel_bits), as_bytes(t.norms.to(torch.float16))]
        if fmt.channel_bits is not None:
            m = quantize_mixed(x, fmt.channel_bits, g, check=check)
            sm = torch.stack([m.span, m.minimum], dim=-1).to(torch.float16)
            return [pack_mixed(m.codes, m.bits), as_bytes(sm.flatten(-2))]
        if ranges is not None:
            check_ranges(*ranges, self.dim // g)
            q = quantize_ranged(x, fmt.bits, g, *ranges, check=check)
        elif fmt.clip is not None:
            q = quantize_clipped(x, fmt.bits, g, fmt.clip, check=check)
        else:
            q = quantize_groups(x, fmt.bits, g, check=check)
        sm = torch.stack([q.scale, q.minimum], dim=-1).to(torch.float16)  # [..., groups, 2]
        return [self._pack(q.codes), as_bytes(sm.flatten(-2))]

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.planar:
            return pack_words(codes, self.fmt.bits, self.planes)
        return pack_codes(codes, self.fmt.bits)

    def codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Integer codes ``[..., dim]`` (uint8) of the ``codes`` field of a plain integer format."""
        if self.planar:
            return unpack_planar(packed, self.fmt.bits, self.planes)
        return unpack_codes(packed.contiguous(), self.fmt.bits, self.dim)

    def decode(
        self, parts: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Values ``[..., dim]`` of the fields ``parts`` (uint8 ``[..., nbytes]`` each, views allowed).
        ``valid [...]`` (bool): tokens whose bytes are not to be trusted (unwritten slots) read as 0."""
        fmt, g = self.fmt, self.group_size
        if fmt.kind == "bf16":
            x = from_bytes(parts[0], self.hp_dtype).to(dtype)
            return x if valid is None else x.masked_fill_(~valid[..., None], 0.0)
        if fmt.kind == "fp8":
            v, sc = from_bytes(parts[0], torch.float8_e4m3fn), from_bytes(parts[1], torch.float32)
            if valid is not None:
                sc = sc.masked_fill(~valid[..., None], 0.0)
                v = v.view(torch.uint8).masked_fill(~valid[..., None], 0).view(torch.float8_e4m3fn)
            return dequantize_fp8(v, sc, FP8_TILE, dtype)
        if fmt.turbo:
            bits = fmt.widths(self.dim)
            norms = from_bytes(parts[1], torch.float16)
            if valid is not None:
                norms = norms.masked_fill(~valid[..., None], 0.0)
            return dequantize_turbo(unpack_mixed(parts[0].contiguous(), bits), norms, bits, dtype)
        sm = from_bytes(parts[1], torch.float16).unflatten(-1, (-1, 2))
        if valid is not None:  # scale and minimum 0: the token reads as 0 whatever its codes (codes are finite)
            sm = sm.masked_fill(~valid[..., None, None], 0.0)
        if fmt.channel_bits is not None:
            bits = fmt.channel_bits
            return dequantize_mixed(unpack_mixed(parts[0].contiguous(), bits), sm[..., 1], sm[..., 0], bits, g, dtype)
        return dequantize_groups(self.codes(parts[0]), sm[..., 0], sm[..., 1], g, dtype)
