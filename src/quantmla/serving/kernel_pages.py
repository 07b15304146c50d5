"""An engine's field-major record pages seen in place as the decode kernels' page store.

:func:`quantmla.kernels.decode.mla_decode` reads a store through ``layout`` (a
:class:`~quantmla.kernels.layout.PagedLayout`), ``content`` (BF16 pages) or ``kernel_views()`` (the
typed words of each field, ``[pages, page_size, words]``) and takes each view's page stride from the
view. Inside a field-major page every field has the kernel's own per-page layout
(:meth:`quantmla.serving.records.RecordLayout.page_view`), so these views are strided windows of the
engine's one ``uint8`` tensor: nothing is copied.
"""

from __future__ import annotations

import torch

from quantmla.kernels.layout import NoKernelLayout, PagedLayout
from quantmla.serving.records import RecordLayout


class KernelPages:
    """``pages [num_blocks, block_size, record_bytes]`` (uint8, field-major) as a kernel store.

    Raises :class:`~quantmla.kernels.layout.NoKernelLayout` for a scheme or geometry the kernels do not
    cover (``fp8``, ``c8r8``; block sizes other than 16-128), with the reason.
    """

    def __init__(self, pages: torch.Tensor, records: RecordLayout) -> None:
        if pages.dtype != torch.uint8 or pages.dim() != 3 or pages.shape[-1] != records.record_bytes:
            raise ValueError(
                f"pages must be uint8 [num_blocks, block_size, {records.record_bytes}], got {pages.dtype}"
                f" {tuple(pages.shape)}"
            )
        if pages.stride(-1) != 1 or pages.stride(-2) != pages.shape[-1]:
            raise ValueError("each page must be contiguous")
        self.records = records
        self.layout = PagedLayout.for_scheme(
            records.scheme,
            kv_lora_rank=records.kv_lora_rank,
            rope_dim=records.rope_dim,
            group_size=records.group_size,
            page_size=pages.shape[1],
        )
        if pages.data_ptr() % 16 or pages.stride(0) % 16:
            raise NoKernelLayout("pages must start 16-byte aligned with a page stride of a multiple of 16 bytes")
        self.pages = pages
        if not self.layout.quantized:
            self.content = records.page_view(pages, "bf16").view(torch.bfloat16)  # [pages, bs, d_c + d_r]
            self._views = None
            return
        self.content = None
        cword = torch.int32 if self.layout.content_bits == 4 else torch.int16
        self._views = (
            records.page_view(pages, "c_codes").view(cword),
            records.page_view(pages, "c_sm").view(torch.int32),
            records.page_view(pages, "r_codes").view(torch.int16),
            records.page_view(pages, "r_sm").view(torch.int32),
        )

    def kernel_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Content words, content scale|minimum words, RoPE words, RoPE scale|minimum words: views
        ``[pages, page_size, words]`` of :attr:`pages` (the layout of
        :meth:`quantmla.kernels.layout.PagedLatentStore.kernel_views` within each page)."""
        if self._views is None:
            raise ValueError("a BF16 store has no low-bit views; the kernel reads .content")
        return self._views
