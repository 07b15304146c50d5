"""Cache schemes: how each of the two cached paths (content latent, RoPE key) is stored.

Names: ``bf16`` (nothing quantised), ``fp8`` (content FP8 e4m3 with a power-of-two scale per 128
values, RoPE key BF16: FlashMLA's DeepSeek-V3.2 layout) and ``c<spec>r<spec>`` with, for each path,

* ``<b>``: ``b`` bits in {2, 3, 4, 8}, per-token asymmetric affine groups (fp16 scale and minimum per
  group of the cache's ``group_size``), e.g. ``c4r4``, ``c2r4``;
* optional ``g<n>``: this path's own group of ``n`` channels (``c2g128``);
* optional ``q<pct>``: clip each token at the ``pct``-th percentile of ``|x|`` first (``c2g128q94``:
  RAQ-MLA's INT2 latent, :mod:`~quantmla.quant.clip`);
* optional ``p<P>``: per channel within a page of ``P`` tokens instead of per-token groups (``r4p128``:
  RAQ-MLA's RoPE key, :mod:`~quantmla.quant.channel`; the tokens of a page still filling stay
  unquantised);
* or ``m<b>x<n>-<b>x<n>...``: mixed widths, runs of ``n`` channels at ``b`` bits in channel order, sharing
  per-token groups (:mod:`~quantmla.quant.mixed`; Block-GTQ's allocation over the RoPE pairs);
* optional ``t`` last: TurboQuant-MSE instead of the affine grid, a random rotation and a Lloyd-Max
  codebook per group of equal width, one fp16 norm a group (:mod:`~quantmla.quant.turbo`): ``r3t`` is
  TQ-MSE at 3 bits over the whole key, ``rm4x16-3x32-2x16t`` Block-GTQ's quantiser for an allocation.

So RAQ-MLA's quantiser table is ``c2g128q94r4p128``. Every format reports its storage per token and its
effective bits per element (BPE), metadata included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from quantmla.formats.packing import packed_bytes
from quantmla.formats.paths import PathLayout
from quantmla.quant.affine import QUANT_BITS, quantize_groups
from quantmla.quant.channel import dequantize_per_channel, quantize_per_channel
from quantmla.quant.clip import check_quantile, quantize_clipped
from quantmla.quant.fp8 import quantize_fp8
from quantmla.quant.mixed import (
    check_channel_bits,
    dequantize_channels_mixed,
    quantize_channels_mixed,
    quantize_mixed,
)
from quantmla.quant.turbo import TURBO_BITS, quantize_turbo

PathKind = Literal["bf16", "int", "fp8"]
_SPEC = r"(?:(\d+)|m(\d+x\d+(?:-\d+x\d+)*))(?:g(\d+))?(?:q(\d+(?:\.\d+)?))?(?:p(\d+))?(t)?"
_INT_RE = re.compile(rf"^c{_SPEC}r{_SPEC}$")


@dataclass(frozen=True)
class PathFormat:
    """Storage of one cached path.

    ``group``: this path's group size (``None``: the cache's); ``clip``: per-token clipping quantile;
    ``page``: per channel within pages of this many tokens; ``channel_bits``: a width per channel (mixed);
    ``turbo``: TurboQuant-MSE per group of equal width instead of affine groups.
    """

    kind: PathKind
    bits: int = 16
    group: int | None = None
    clip: float | None = None
    page: int | None = None
    channel_bits: tuple[int, ...] | None = None
    turbo: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("bf16", "int", "fp8"):
            raise ValueError(f"path kind {self.kind!r} unknown; valid: bf16, int, fp8")
        extras = (self.group, self.clip, self.page, self.channel_bits)
        if self.kind != "int" and (any(e is not None for e in extras) or self.turbo):
            raise ValueError(f"group, clipping, pages, mixed widths and TQ-MSE apply to integer paths, not {self.kind}")
        if self.turbo:
            if self.group is not None or self.clip is not None or self.page is not None:
                raise ValueError("TQ-MSE (t) groups channels by width: it takes no g<n>, q<pct> or p<P>")
            bad = sorted({b for b in (self.channel_bits or (self.bits,)) if b and b not in TURBO_BITS})
            if bad:
                raise ValueError(f"TQ-MSE widths {bad} not supported; valid: {TURBO_BITS} (0 in mixed widths)")
        elif self.kind == "int" and self.channel_bits is None and self.bits not in QUANT_BITS:
            raise ValueError(f"integer path bits={self.bits} not supported; valid: {QUANT_BITS}")
        if self.group is not None and self.group <= 0:
            raise ValueError(f"group={self.group} must be positive")
        if self.clip is not None:
            check_quantile(self.clip)
        if self.page is not None and (self.page <= 0 or self.group is not None or self.clip is not None):
            raise ValueError(f"page={self.page}: a positive page size, without a channel group or clipping")
        if self.channel_bits is not None:
            check_channel_bits(self.channel_bits, len(self.channel_bits))
            if self.clip is not None:
                raise ValueError("mixed channel widths take no clipping")

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    @property
    def uniform(self) -> bool:
        """Plain per-token groups at the cache's group size: the formats the kernels and records hold."""
        plain = self.group is None and self.clip is None and self.page is None and self.channel_bits is None
        return plain and not self.turbo

    @property
    def spec(self) -> str:
        """This path's part of a scheme name (``c<spec>r<spec>``)."""
        if self.channel_bits is not None:
            runs: list[list[int]] = []
            for b in self.channel_bits:
                if runs and runs[-1][0] == b:
                    runs[-1][1] += 1
                else:
                    runs.append([b, 1])
            out = "m" + "-".join(f"{b}x{n}" for b, n in runs)
        else:
            out = str(self.bits)
        if self.group is not None:
            out += f"g{self.group}"
        if self.clip is not None:
            out += f"q{100 * self.clip:g}"
        if self.page is not None:
            out += f"p{self.page}"
        return out + ("t" if self.turbo else "")

    def widths(self, dim: int) -> tuple[int, ...]:
        """The width of each of ``dim`` channels (mixed widths, else ``bits`` everywhere)."""
        return self.channel_bits if self.channel_bits is not None else (self.bits,) * dim

    def group_size(self, default: int) -> int:
        return self.group if self.group is not None else default

    def fake_quantize(self, x: torch.Tensor, group_size: int = 64) -> torch.Tensor:
        """``x`` stored and read back in this format (so it equals the cache's values). A paged format
        quantises the whole pages along ``x``'s token axis (dim -2) and leaves a page still filling as is."""
        if self.kind == "bf16":
            return x
        if self.kind == "fp8":
            return quantize_fp8(x).dequantize(x.dtype)
        g = self.group_size(group_size)
        if self.channel_bits is not None and len(self.channel_bits) != x.shape[-1]:
            raise ValueError(f"{len(self.channel_bits)} channel widths for a path of {x.shape[-1]} channels")
        if self.turbo:
            return quantize_turbo(x, self.widths(x.shape[-1])).dequantize(x.dtype)
        if self.page is not None:
            full = x.shape[-2] // self.page * self.page
            if full == 0:
                return x
            if self.channel_bits is not None:
                m = quantize_channels_mixed(x[..., :full, :], self.channel_bits, self.page)
                q = dequantize_channels_mixed(m.codes, m.minimum, m.span, m.bits, self.page, x.dtype)
            else:
                q = dequantize_per_channel(quantize_per_channel(x[..., :full, :], self.bits, self.page), x.dtype)
            return torch.cat([q, x[..., full:, :]], dim=-2)
        if self.channel_bits is not None:
            return quantize_mixed(x, self.channel_bits, g).dequantize(x.dtype)
        if self.clip is not None:
            return quantize_clipped(x, self.bits, g, self.clip).dequantize(x.dtype)
        return quantize_groups(x, self.bits, g).dequantize(x.dtype)

    def bytes_per_token(self, dim: int, group_size: int, hp_bytes: int = 2) -> float:
        """Persistent bytes for one token's ``dim`` values in this format: its stored fields
        (:class:`~quantmla.formats.paths.PathLayout`), or a paged format's codes with its metadata amortised
        over its page (a fraction); ``hp_bytes`` a value for an unquantised path."""
        if self.kind == "bf16":
            return dim * hp_bytes
        if self.page is not None:
            codes = packed_bytes(self.channel_bits) if self.channel_bits is not None else dim * self.bits / 8
            return codes + dim * 4 / self.page
        return PathLayout(self, dim, group_size, "r").nbytes  # the bytes do not depend on the path's planes

    def bits_per_element(self, dim: int, group_size: int, hp_bytes: int = 2) -> float:
        """Effective bits per cached element (BPE), metadata included."""
        return 8 * self.bytes_per_token(dim, group_size, hp_bytes) / dim


@dataclass(frozen=True)
class CacheScheme:
    name: str
    content: PathFormat
    rope: PathFormat

    @property
    def quantized(self) -> bool:
        return self.content.quantized or self.rope.quantized

    @property
    def uniform(self) -> bool:
        """Both paths plain per-token groups at the cache's group size (what the kernels and records hold)."""
        return self.content.uniform and self.rope.uniform

    def bytes_per_token(self, kv_lora_rank: int, rope_dim: int, group_size: int = 64) -> float:
        """Persistent bytes of one quantised token (both paths; a paged path's metadata amortised)."""
        return self.content.bytes_per_token(kv_lora_rank, group_size) + self.rope.bytes_per_token(rope_dim, group_size)

    def bits_per_element(self, kv_lora_rank: int, rope_dim: int, group_size: int = 64) -> float:
        """Effective bits per cached element (BPE) over both paths, metadata included."""
        return 8 * self.bytes_per_token(kv_lora_rank, rope_dim, group_size) / (kv_lora_rank + rope_dim)


def valid_scheme_names() -> list[str]:
    """The plain names (each path's bits only); ``parse_scheme`` accepts the longer ``c<spec>r<spec>`` too."""
    ints = [f"c{c}r{r}" for c in QUANT_BITS for r in QUANT_BITS]
    return ["bf16", "fp8", *ints]


def _path(bits, runs, group, pct, page, turbo) -> PathFormat:
    mixed = None
    if runs:
        mixed = tuple(int(b) for run in runs.split("-") for b, n in [run.split("x")] for _ in range(int(n)))
    return PathFormat(
        "int",
        int(bits) if bits else 16,
        group=int(group) if group else None,
        clip=float(pct) / 100 if pct else None,
        page=int(page) if page else None,
        channel_bits=mixed,
        turbo=bool(turbo),
    )


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
    if m:
        try:
            content, rope = _path(*m.groups()[:6]), _path(*m.groups()[6:])
        except ValueError as e:
            raise ValueError(f"unknown cache scheme {name!r} ({e}); {_VALID}") from None
        return CacheScheme(f"c{content.spec}r{rope.spec}", content, rope)
    raise ValueError(f"unknown cache scheme {name!r}; {_VALID}")


_VALID = (
    f"valid: bf16, fp8, or c<b>r<b> with content and RoPE bits in {QUANT_BITS} (e.g. c4r4, c2r4, c8r8), each "
    "optionally followed by g<group>, q<clip percentile> or p<page> (e.g. c2g128q94r4p128), or m<b>x<n>-... mixed "
    "widths; a trailing t stores a path with TQ-MSE (e.g. c4r3t, c4rm4x16-3x32-2x16t)"
)
