"""One token of the MLA cache as a fixed-size byte record, for engines that page opaque bytes (vLLM) and for
the decode kernels' pages.

A record holds both cached paths of one token, each path's fields (:class:`~quantmla.formats.paths.PathLayout`,
the one definition of a path's bytes) back to back, content first, names prefixed ``c_`` and ``r_``:

* ``bf16``: one field ``bf16``, ``[c | k^R]`` in BF16 (2 * (d_c + d_r) bytes: 1152 at DeepSeek geometry);
* ``fp8``: content FP8 e4m3, its float32 power-of-two scale per 128 values, the RoPE key in BF16
  (656 bytes, FlashMLA's DeepSeek-V3.2 layout);
* ``c<b>r<b>``: per path the codes, then per group one fp16 (scale, minimum) pair. 4- and 2-bit codes are
  group-planar words (:func:`quantmla.formats.packing.pack_words`), 8-bit codes one per byte.
  C4R4: 256 + 32 + 32 + 4 = 324 bytes, C2R4 196, C8R8 612.

Every field starts at a multiple of 4 bytes (padding before a field that would not) and records are a
multiple of 4 bytes; the schemes above need no padding. The values are exactly those of
:class:`quantmla.cache.QuantizedLatentCache` (the same path layouts, per token).

**Pages.** A page of ``block_size`` tokens (``[block_size, record_bytes]`` bytes, vLLM's shape) holds its
records *field-major*: each field's bytes for all the page's tokens back to back, then the next field
(:meth:`RecordLayout.page_view`). Inside a page every field is then an array ``[block_size, nbytes]`` of its
own, 16-byte aligned at a block size of 64, which is how the decode kernels read it
(:class:`quantmla.kernels.layout.PagedLatentStore`). With one field (``bf16``) the page is the token records
themselves: vLLM's own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.formats.paths import PathLayout, as_bytes
from quantmla.formats.scheme import CacheScheme, parse_scheme

#: every field starts at a multiple of this many bytes, and a record's size is one
ALIGN = 4


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one token: ``fields[name] = (offset, nbytes)``. Any scheme whose paths are per-token
    formats (not ``p<P>``)."""

    scheme: str
    kv_lora_rank: int = 512
    rope_dim: int = 64
    group_size: int = 64
    #: pad each record to this many bytes (an engine whose layers must share one page size; ``None``: none)
    pad_to: int | None = None
    fields: dict = field(init=False, compare=False, repr=False)
    #: bytes of one record (the fields, with any alignment padding)
    record_bytes: int = field(init=False, compare=False, repr=False)
    paths: tuple[PathLayout, PathLayout] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        s = parse_scheme(self.scheme)
        object.__setattr__(self, "scheme", s.name)
        c = PathLayout(s.content, self.kv_lora_rank, self.group_size, "c")
        r = PathLayout(s.rope, self.rope_dim, self.group_size, "r")
        object.__setattr__(self, "paths", (c, r))
        if self.single:  # one field [c | k^R]: vLLM's own token layout
            sizes = [("bf16", c.nbytes + r.nbytes)]
        else:
            sizes = [(f"{p.path}_{name}", n) for p in (c, r) for name, n in p.fields]
        fields, off = {}, 0
        for name, n in sizes:
            off = -(-off // ALIGN) * ALIGN
            fields[name] = (off, n)
            off += n
        object.__setattr__(self, "fields", fields)
        size = -(-off // ALIGN) * ALIGN
        if self.pad_to is not None:
            if self.pad_to < size or self.pad_to % ALIGN:
                raise ValueError(f"pad_to={self.pad_to}: a multiple of {ALIGN} of at least {size} bytes ({s.name})")
            size = self.pad_to
        object.__setattr__(self, "record_bytes", size)

    @property
    def single(self) -> bool:
        """Both paths BF16: one field ``bf16`` holding ``[c | k^R]``."""
        s = self.cache_scheme
        return s.content.kind == s.rope.kind == "bf16"

    @property
    def cache_scheme(self) -> CacheScheme:
        return parse_scheme(self.scheme)

    @property
    def dense(self) -> bool:
        """Whether the fields are back to back with no padding (the plain schemes, unpadded)."""
        return sum(n for _, n in self.fields.values()) == self.record_bytes

    def view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of ``records [..., record_bytes]`` (uint8) as a strided byte view."""
        off, n = self.fields[name]
        return records[..., off : off + n]

    def encode(self, c: torch.Tensor, r: torch.Tensor, check: bool = False, ranges=None) -> list[torch.Tensor]:
        """Each field's bytes ``[N, nbytes]`` (uint8, in field order) of tokens ``c [N, d_c]``, ``r [N, d_r]``.
        ``ranges``: learned ranges per path, ``(content, rope)``, each ``(clip_ratio, gain)`` or ``None``."""
        if self.single:
            return [as_bytes(torch.cat([c, r], dim=-1).to(torch.bfloat16))]
        rc, rr = ranges if ranges is not None else (None, None)
        return self.paths[0].encode(c, check, rc) + self.paths[1].encode(r, check, rr)

    def pack(self, c: torch.Tensor, r: torch.Tensor, check: bool = False) -> torch.Tensor:
        """Records ``[N, record_bytes]`` (uint8) of tokens ``c [N, d_c]``, ``r [N, d_r]``."""
        return self._assemble(self.encode(c, r, check))

    def _assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Records ``[..., record_bytes]`` of each field's bytes ``[..., nbytes]`` (any padding zero)."""
        if self.dense:
            return torch.cat(parts, dim=-1)
        out = parts[0].new_zeros(*parts[0].shape[:-1], self.record_bytes)
        for (off, n), part in zip(self.fields.values(), parts, strict=True):
            out[..., off : off + n] = part
        return out

    def page_view(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of field-major ``pages [..., block_size, record_bytes]`` (uint8, each page
        contiguous) as a view ``[..., block_size, nbytes]``."""
        off, n = self.fields[name]
        bs = pages.shape[-2]
        return pages.flatten(-2)[..., bs * off : bs * (off + n)].unflatten(-1, (bs, n))

    def write_pages(
        self, pages: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor, check: bool = False,
        ranges=None,
    ) -> None:  # fmt: skip
        """Store tokens ``c [N, d_c]``, ``r [N, d_r]`` at flat ``slots`` (``block * block_size + offset``)
        of field-major ``pages [num_blocks, block_size, record_bytes]``, quantised once. ``check``: reject
        values the format cannot hold (a GPU sync); ``ranges``: learned ranges (:meth:`encode`)."""
        bs = pages.shape[1]
        blk, off = slots // bs, slots % bs
        for name, part in zip(self.fields, self.encode(c, r, check, ranges), strict=True):
            self.page_view(pages, name)[blk, off] = part

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Token records ``[..., block_size, record_bytes]`` of field-major ``pages`` (a copy)."""
        return self._assemble([self.page_view(pages, name) for name in self.fields])

    def read_slots(self, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Token records ``[N, record_bytes]`` at flat ``slots`` of field-major ``pages``."""
        bs = pages.shape[1]
        blk, off = slots // bs, slots % bs
        return self._assemble([self.page_view(pages, name)[blk, off] for name in self.fields])

    def to_pages(self, records: torch.Tensor) -> torch.Tensor:
        """Field-major pages ``[num_blocks, block_size, record_bytes]`` of token ``records`` of the same
        shape (the inverse of :meth:`read_pages`)."""
        nb, bs, _ = records.shape
        out = records.new_zeros(nb, bs * self.record_bytes)
        for name, (off, n) in self.fields.items():
            out[:, bs * off : bs * (off + n)] = self.view(records, name).reshape(nb, -1)
        return out.view(nb, bs, self.record_bytes)

    def unpack(
        self, records: torch.Tensor, dtype: torch.dtype = torch.float32, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c [..., d_c], r [..., d_r])`` read back from ``records [..., record_bytes]``.

        ``valid [...]`` (bool): tokens whose bytes are not to be trusted (unwritten slots) read as 0.
        """
        if self.single:
            x = self.view(records, "bf16").contiguous().view(torch.bfloat16).to(dtype)
            x = x if valid is None else x.masked_fill_(~valid[..., None], 0.0)
            return x[..., : self.kv_lora_rank], x[..., self.kv_lora_rank :]
        c, r = self.paths
        return (
            c.decode([self.view(records, f"c_{name}") for name, _ in c.fields], dtype, valid),
            r.decode([self.view(records, f"r_{name}") for name, _ in r.fields], dtype, valid),
        )
