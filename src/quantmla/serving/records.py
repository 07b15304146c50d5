"""One token of the MLA cache as a fixed-size byte record, for engines that page opaque bytes (vLLM).

A record holds both cached paths of one token in the cache scheme's format, fields back to back:

* ``bf16``: ``[c | k^R]`` in BF16 (2 * (d_c + d_r) bytes: 1152 at DeepSeek geometry);
* ``fp8``: content FP8 e4m3, its float32 power-of-two scale per 128 values, the RoPE key in BF16
  (656 bytes, FlashMLA's DeepSeek-V3.2 layout);
* ``c<b>r<b>``: per path the codes, then per group one fp16 (scale, minimum) pair. 4- and 2-bit codes
  are packed group-planar as in the decode kernels' pages (:func:`quantmla.kernels.layout.pack_words`),
  8-bit codes one per byte. C4R4: 256 + 32 + 32 + 4 = 324 bytes, C2R4 196, C8R8 612.

Every field starts at a multiple of 4 bytes and records are a multiple of 4 bytes. The values are
exactly those of :class:`quantmla.cache.QuantizedLatentCache` (same quantisers, per token).

**Pages.** An engine's page of ``block_size`` tokens (``[block_size, record_bytes]`` bytes, vLLM's
shape) holds its records *field-major*: each field's bytes for all the page's tokens back to back,
then the next field (:meth:`RecordLayout.page_view`). Inside a page every field is then laid out as
the decode kernels' own arrays (:class:`quantmla.kernels.layout.PagedLatentStore`), 16-byte aligned at
a block size of 64, so the kernels read a page in place with only the page stride changed. With one
field (``bf16``) the page is the token records themselves: vLLM's own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.kernels.layout import CONTENT_PLANES, ROPE_PLANES, pack_words
from quantmla.quant.affine import check_group, quantize_groups
from quantmla.quant.fp8 import FP8_TILE, dequantize_fp8, quantize_fp8
from quantmla.quant.scheme import CacheScheme, PathFormat, parse_scheme

#: the schemes a record can hold (integer paths: 2, 4 or 8 bits)
RECORD_SCHEMES = ("bf16", "fp8", "c8r8", "c4r4", "c2r4")


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one token: ``fields[name] = (offset, nbytes)``."""

    scheme: str
    kv_lora_rank: int = 512
    rope_dim: int = 64
    group_size: int = 64
    fields: dict = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        s = parse_scheme(self.scheme)
        if s.name not in RECORD_SCHEMES:
            raise ValueError(f"scheme {self.scheme!r} has no record layout; valid: {', '.join(RECORD_SCHEMES)}")
        object.__setattr__(self, "scheme", s.name)
        sizes: list[tuple[str, int]] = []
        if s.content.kind == s.rope.kind == "bf16":  # one field [c | k^R]: vLLM's own token layout
            sizes = [("bf16", 2 * (self.kv_lora_rank + self.rope_dim))]
        for path, fmt, dim in (("c", s.content, self.kv_lora_rank), ("r", s.rope, self.rope_dim)) * (not sizes):
            sizes += _path_fields(path, fmt, dim, self.group_size)
        fields, off = {}, 0
        for name, n in sizes:
            fields[name] = (off, n)
            off += n
        if off % 4 or any(o % 4 for o, _ in fields.values()):
            raise ValueError(f"{s.name} at d_c={self.kv_lora_rank}, d_r={self.rope_dim}: fields not 4-byte aligned")
        object.__setattr__(self, "fields", fields)

    @property
    def cache_scheme(self) -> CacheScheme:
        return parse_scheme(self.scheme)

    @property
    def record_bytes(self) -> int:
        return sum(n for _, n in self.fields.values())

    def view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of ``records [..., record_bytes]`` (uint8) as a strided byte view."""
        off, n = self.fields[name]
        return records[..., off : off + n]

    def _parts(self, c: torch.Tensor, r: torch.Tensor, check: bool) -> list[torch.Tensor]:
        s = self.cache_scheme
        if "bf16" in self.fields:
            return [_bytes(torch.cat([c, r], dim=-1).to(torch.bfloat16))]
        parts = _encode("c", s.content, c, self.group_size, check) + _encode("r", s.rope, r, self.group_size, check)
        return [p.reshape(c.shape[0], -1) for p in parts]

    def pack(self, c: torch.Tensor, r: torch.Tensor, check: bool = False) -> torch.Tensor:
        """Records ``[N, record_bytes]`` (uint8) of tokens ``c [N, d_c]``, ``r [N, d_r]``."""
        return torch.cat(self._parts(c, r, check), dim=-1)

    def page_view(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of field-major ``pages [..., block_size, record_bytes]`` (uint8, each page
        contiguous) as a view ``[..., block_size, nbytes]``."""
        off, n = self.fields[name]
        bs = pages.shape[-2]
        return pages.flatten(-2)[..., bs * off : bs * (off + n)].unflatten(-1, (bs, n))

    def write_pages(self, pages: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> None:
        """Store tokens ``c [N, d_c]``, ``r [N, d_r]`` at flat ``slots`` (``block * block_size + offset``)
        of field-major ``pages [num_blocks, block_size, record_bytes]``, quantised once."""
        bs = pages.shape[1]
        blk, off = slots // bs, slots % bs
        for name, part in zip(self.fields, self._parts(c, r, False), strict=True):
            self.page_view(pages, name)[blk, off] = part

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Token records ``[..., block_size, record_bytes]`` of field-major ``pages`` (a copy)."""
        return torch.cat([self.page_view(pages, name) for name in self.fields], dim=-1)

    def read_slots(self, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Token records ``[N, record_bytes]`` at flat ``slots`` of field-major ``pages``."""
        bs = pages.shape[1]
        blk, off = slots // bs, slots % bs
        return torch.cat([self.page_view(pages, name)[blk, off] for name in self.fields], dim=-1)

    def to_pages(self, records: torch.Tensor) -> torch.Tensor:
        """Field-major pages ``[num_blocks, block_size, record_bytes]`` of token ``records`` of the same
        shape (the inverse of :meth:`read_pages`)."""
        nb, bs, _ = records.shape
        flat = [self.view(records, name).reshape(nb, -1) for name in self.fields]
        return torch.cat(flat, dim=-1).view(nb, bs, self.record_bytes)

    def unpack(
        self, records: torch.Tensor, dtype: torch.dtype = torch.float32, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c [..., d_c], r [..., d_r])`` read back from ``records [..., record_bytes]``.

        ``valid [...]`` (bool): tokens whose bytes are not to be trusted (unwritten slots) read as 0.
        """
        s = self.cache_scheme
        if "bf16" in self.fields:
            x = self.view(records, "bf16").contiguous().view(torch.bfloat16).to(dtype)
            x = x if valid is None else x.masked_fill_(~valid[..., None], 0.0)
            return x[..., : self.kv_lora_rank], x[..., self.kv_lora_rank :]
        c = _decode(self, "c", s.content, records, dtype, valid)
        r = _decode(self, "r", s.rope, records, dtype, valid)
        return c, r


def _path_fields(path: str, fmt: PathFormat, dim: int, group: int) -> list[tuple[str, int]]:
    if fmt.kind == "bf16":
        return [(f"{path}_bf16", 2 * dim)]
    if fmt.kind == "fp8":
        check_group(dim, FP8_TILE)
        return [(f"{path}_fp8", dim), (f"{path}_fp8_scale", 4 * (dim // FP8_TILE))]
    check_group(dim, group)
    if fmt.bits not in (2, 4, 8):
        raise ValueError(f"{fmt.bits}-bit codes have no record layout; valid: 2, 4, 8")
    return [(f"{path}_codes", dim * fmt.bits // 8), (f"{path}_sm", 4 * (dim // group))]


def _planes(path: str) -> int:
    return CONTENT_PLANES if path == "c" else ROPE_PLANES


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def _encode(path: str, fmt: PathFormat, x: torch.Tensor, group: int, check: bool) -> list[torch.Tensor]:
    if fmt.kind == "bf16":
        return [_bytes(x.to(torch.bfloat16))]
    if fmt.kind == "fp8":
        q = quantize_fp8(x, check=check)
        return [_bytes(q.values), _bytes(q.scale.float())]
    q = quantize_groups(x, fmt.bits, group, check=check)
    codes = q.codes if fmt.bits == 8 else pack_words(q.codes, fmt.bits, _planes(path))
    sm = torch.stack([q.scale, q.minimum], dim=-1).to(torch.float16)  # [N, groups, 2]
    return [codes, _bytes(sm)]


def _decode(lay: RecordLayout, path: str, fmt: PathFormat, rec: torch.Tensor, dtype, valid) -> torch.Tensor:
    lead = rec.shape[:-1]
    if fmt.kind == "bf16":
        x = lay.view(rec, f"{path}_bf16").contiguous().view(torch.bfloat16).to(dtype)
        return x if valid is None else x.masked_fill_(~valid[..., None], 0.0)
    if fmt.kind == "fp8":
        v = lay.view(rec, f"{path}_fp8").contiguous().view(torch.float8_e4m3fn)
        sc = lay.view(rec, f"{path}_fp8_scale").contiguous().view(torch.float32)
        if valid is not None:
            sc = sc.masked_fill(~valid[..., None], 0.0)
            v = v.view(torch.uint8).masked_fill(~valid[..., None], 0).view(torch.float8_e4m3fn)
        return dequantize_fp8(v, sc, FP8_TILE, dtype)
    codes = lay.view(rec, f"{path}_codes")
    codes = codes if fmt.bits == 8 else unpack_planar(codes, fmt.bits, _planes(path))
    sm = lay.view(rec, f"{path}_sm").contiguous().view(torch.float16).reshape(*lead, -1, 2).float()
    if valid is not None:  # scale and minimum 0: the token reads as 0 whatever its bytes (codes are finite)
        sm = sm.masked_fill_(~valid[..., None, None], 0.0)
    x = codes.unflatten(-1, (-1, lay.group_size)) * sm[..., 0:1]  # uint8 * float32: one pass, float32 out
    return x.add_(sm[..., 1:2]).flatten(-2).to(dtype)


def unpack_planar(packed: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """:func:`~quantmla.kernels.layout.unpack_words` with byte-wide operations only (no int64 words):
    byte ``i`` of word ``e`` holds the codes of planes ``i * 8 / bits ...`` at ``bits``-bit steps."""
    per_byte = 8 // bits
    by = packed.unflatten(-1, (-1, planes // per_byte))  # [..., words, bytes of a word]
    mask = (1 << bits) - 1
    parts = [by & mask] + [(by >> (bits * k)) & mask for k in range(1, per_byte - 1)] + [by >> (8 - bits)]
    runs = torch.stack(parts, dim=-1).flatten(-2)  # [..., words, planes]: plane p = byte * per_byte + k
    return runs.transpose(-1, -2).flatten(-2)  # channel p * words + e
