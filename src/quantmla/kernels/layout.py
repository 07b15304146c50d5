"""The decode kernels' page store: field-major record pages, read in place.

Pages hold ``page_size`` tokens of one sequence; a block table maps each sequence's logical pages to physical
ones. A page is ``page_size`` token records of :class:`~quantmla.formats.records.RecordLayout` stored
field-major (each field's bytes for all the page's tokens, then the next field), so every field is an array
``[pages, page_size, nbytes]`` the kernels read with the page stride of the pool:

* content codes (group-planar words, :func:`quantmla.formats.packing.pack_words`), then per token and group
  the fp16 (scale, minimum) pair, so the kernel reads one 32-bit word per token and group;
* RoPE codes and their (scale, minimum) pairs likewise;
* or, unquantised, the BF16 token ``[c | k^R]`` (FlashMLA's dense layout, vLLM's own).

An engine's pages (vLLM's ``[num_blocks, block_size, record_bytes]`` uint8 tensor) are the same thing:
:meth:`PagedLatentStore.from_pages` views them as a store without a copy. :class:`PagedLayout` says which
layouts the kernels read (bits, geometry, page size) and refuses the others with the reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantmla.formats.packing import CONTENT_PLANES, ROPE_PLANES
from quantmla.formats.records import RecordLayout
from quantmla.formats.scheme import parse_scheme

KERNEL_CONTENT_BITS = (16, 4, 2)
KERNEL_ROPE_BITS = (16, 4)
PAGE_SIZES = (16, 32, 64, 128)


class NoKernelLayout(ValueError):
    """The kernel layout cannot hold this cache (scheme format, geometry, group or page size); the
    message says why. The torch path of the cache may still serve it."""


@dataclass(frozen=True)
class PagedLayout:
    """Shape of one paged cache: formats of both paths and the page geometry."""

    content_bits: int
    rope_bits: int
    kv_lora_rank: int = 512
    rope_dim: int = 64
    group_size: int = 64
    page_size: int = 64

    def __post_init__(self) -> None:
        if self.content_bits not in KERNEL_CONTENT_BITS:
            raise NoKernelLayout(f"content_bits={self.content_bits}; the kernel supports {KERNEL_CONTENT_BITS}")
        if self.rope_bits not in KERNEL_ROPE_BITS:
            raise NoKernelLayout(f"rope_bits={self.rope_bits}; the kernel supports {KERNEL_ROPE_BITS}")
        if self.quantized and self.rope_bits == 16:
            raise NoKernelLayout("a quantised content path with a BF16 RoPE key is not a kernel layout")
        if self.quantized:
            for name, d in (("kv_lora_rank", self.kv_lora_rank), ("rope_dim", self.rope_dim)):
                if self.group_size <= 0 or d % self.group_size:
                    raise NoKernelLayout(
                        f"group_size={self.group_size} does not divide {name}={d}; the kernel layout needs a"
                        f" group size dividing both kv_lora_rank={self.kv_lora_rank} and rope_dim={self.rope_dim}"
                    )
        # each plane (a run of d / planes channels) is an MMA operand (>= 16 wide) inside one group
        for name, d, planes in (
            ("kv_lora_rank", self.kv_lora_rank, CONTENT_PLANES),
            ("rope_dim", self.rope_dim, ROPE_PLANES),
        ):
            w = d // planes
            if d % planes or w < 16 or w & (w - 1) or (self.quantized and self.group_size % w):
                raise NoKernelLayout(
                    f"{name}={d}: the kernel layout needs {planes} runs of a power-of-two width >= 16 that"
                    f" divides group_size={self.group_size} (e.g. {name}={planes * 16} .. {planes * self.group_size})"
                )
        if self.page_size not in PAGE_SIZES:
            raise NoKernelLayout(f"page_size={self.page_size}; the kernel layout supports {PAGE_SIZES}")

    @classmethod
    def for_scheme(cls, scheme: str, **kw) -> PagedLayout:
        s = parse_scheme(scheme)

        def b(fmt) -> int:
            if not fmt.uniform:
                raise NoKernelLayout(
                    f"scheme {s.name!r}: the kernel reads plain per-token groups; valid: bf16, c4r4, c2r4"
                )
            if fmt.kind == "fp8":
                raise NoKernelLayout(f"scheme {s.name!r}: the kernel has no FP8 path; valid: bf16, c4r4, c2r4")
            if fmt.kind == "bf16":
                return 16
            if fmt.bits not in KERNEL_CONTENT_BITS:
                raise NoKernelLayout(
                    f"scheme {s.name!r}: the kernel has no INT{fmt.bits} path; valid: bf16, c4r4, c2r4"
                )
            return fmt.bits

        return cls(content_bits=b(s.content), rope_bits=b(s.rope), **kw)

    @property
    def quantized(self) -> bool:
        return self.content_bits != 16

    @property
    def scheme(self) -> str:
        return f"c{self.content_bits}r{self.rope_bits}" if self.quantized else "bf16"

    @functools.cached_property
    def records(self) -> RecordLayout:
        """One token's record: the bytes a page holds per token."""
        return RecordLayout(self.scheme, self.kv_lora_rank, self.rope_dim, self.group_size)

    def bytes_per_token(self) -> int:
        return self.records.record_bytes


def has_kernel(records: RecordLayout) -> bool:
    """Whether the Triton kernels read records of this layout (its scheme at its widths and group size)."""
    try:
        PagedLayout.for_scheme(records.scheme, kv_lora_rank=records.kv_lora_rank, rope_dim=records.rope_dim,
                               group_size=records.group_size)  # fmt: skip
    except NoKernelLayout:
        return False
    return True


class PagedLatentStore:
    """A pool of ``num_pages`` pages of ``layout`` (``pages [num_pages, page_size, record_bytes]``, uint8,
    field-major), and the typed views of each field the kernels read (:meth:`kernel_views`, or
    :attr:`content` for BF16 pages). :meth:`from_pages` takes an engine's pages in place."""

    def __init__(
        self, layout: PagedLayout, num_pages: int, device: str | torch.device = "cpu", pages: torch.Tensor | None = None
    ) -> None:
        self.layout, self.records = layout, layout.records
        if pages is None:
            pages = torch.zeros(num_pages, layout.page_size, self.records.record_bytes, dtype=torch.uint8,
                                device=device)  # fmt: skip
        self.pages, self.num_pages = pages, pages.shape[0]
        if not layout.quantized:
            self.content = self.records.page_view(pages, "bf16").view(torch.bfloat16)  # [pages, page, d_c + d_r]
            self._views = None
            return
        self.content = None
        cword = torch.int32 if layout.content_bits == 4 else torch.int16
        self._views = (
            self.field("c_codes").view(cword),
            self.field("c_sm").view(torch.int32),
            self.field("r_codes").view(torch.int16),
            self.field("r_sm").view(torch.int32),
        )

    @classmethod
    def from_pages(cls, pages: torch.Tensor, records: RecordLayout) -> PagedLatentStore:
        """An engine's field-major ``pages [num_blocks, block_size, record_bytes]`` (uint8) as a store, in place.
        Raises :class:`NoKernelLayout` for a scheme or geometry the kernels do not cover (``fp8``, ``c8r8``;
        block sizes other than 16-128), with the reason."""
        if pages.dtype != torch.uint8 or pages.dim() != 3 or pages.shape[-1] != records.record_bytes:
            raise ValueError(
                f"pages must be uint8 [num_blocks, block_size, {records.record_bytes}], got {pages.dtype}"
                f" {tuple(pages.shape)}"
            )
        if pages.stride(-1) != 1 or pages.stride(-2) != pages.shape[-1]:
            raise ValueError("each page must be contiguous")
        layout = PagedLayout.for_scheme(
            records.scheme, kv_lora_rank=records.kv_lora_rank, rope_dim=records.rope_dim,
            group_size=records.group_size, page_size=pages.shape[1],
        )  # fmt: skip
        if pages.data_ptr() % 16 or pages.stride(0) % 16:
            raise NoKernelLayout("pages must start 16-byte aligned with a page stride of a multiple of 16 bytes")
        return cls(layout, pages.shape[0], pages=pages)

    def field(self, name: str) -> torch.Tensor:
        """Field ``name`` of every page (a view ``[pages, page_size, nbytes]``, uint8)."""
        return self.records.page_view(self.pages, name)

    def tensors(self) -> list[torch.Tensor]:
        """The storage (one tensor: the pages)."""
        return [self.pages]

    def kernel_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Content words (int32 for INT4, int16 for INT2), scale|minimum words (int32), RoPE words
        (int16), RoPE scale|minimum words: views ``[pages, page_size, words]`` of :attr:`pages`, the typed
        words the low-bit kernel reads."""
        if self._views is None:
            raise ValueError("a BF16 store has no low-bit views; the kernel reads .content")
        return self._views

    def nbytes(self) -> int:
        """Bytes of the whole pool (every page, in use or not)."""
        return self.pages.numel() * self.pages.element_size()

    def page_nbytes(self) -> int:
        """Bytes of one page."""
        return self.pages[0].numel() * self.pages.element_size()

    def write(
        self, pages: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor, check: bool = True
    ) -> None:
        """Store tokens ``c [N, d_c]``, ``r [N, d_r]`` at ``(pages[i], slots[i])``, quantised once.
        ``check``: reject non-finite values or values beyond the fp16 range of the scales (this reads the
        values back to the host: a GPU sync; the cache's decode steps pass ``False``)."""
        self.records.write_pages(self.pages, pages * self.layout.page_size + slots, c, r, check=check)

    def read(self, pages: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised ``(c, r)`` of the tokens at ``(pages, slots)``, float32 (the reference path)."""
        return self.records.unpack(self.records.read_slots(self.pages, pages * self.layout.page_size + slots))
