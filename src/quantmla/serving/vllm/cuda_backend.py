"""quantmla's MLA backend for vLLM on CUDA (vLLM 0.26, Hopper): it takes the place of ``FLASH_ATTN_MLA``.

``FLASH_ATTN_MLA`` is vLLM's first MLA choice on sm_90, so the plugin overrides that registration.
While the plugin is not asked for (:mod:`quantmla.serving.vllm.selection`), every method defers to
vLLM's own classes: same metadata builder, same spec, same kernels. When it is asked for:

* :func:`patch_kv_cache_spec` makes every MLA layer ask for ``uint8`` pages of one
  :class:`~quantmla.serving.records.RecordLayout` record a token (324 bytes for C4R4 at 512 + 64),
  stored field-major in the page, so vLLM sizes its blocks from the record (vLLM 0.26 has no
  ``customize_spec``);
* ``do_kv_cache_update`` quantises and packs the new tokens into their slots, once, in one fused
  Triton launch (:func:`quantmla.kernels.write.write_records`; the torch path for ``fp8``/``c8r8``);
* decode reads the pages in place through quantmla's Triton kernels
  (:class:`~quantmla.serving.kernel_pages.KernelPages`, page strides of the engine's tensor); schemes
  the kernels do not cover (``fp8``, ``c8r8``) decode through the torch path without CUDA graphs,
  and the log says which ran;
* prefill attends its own tokens as stored (read back from the slots just written), and the prefill
  context (chunked prefill, prefix-cache hits, recomputation after preemption) is gathered and
  dequantised from the pages by the same unpacking (:func:`patch_context_gather`).
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import replace

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata, MLACommonMetadataBuilder
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.flashattn_mla import (
    FlashAttnMLABackend,
    FlashAttnMLAImpl,
    FlashAttnMLAMetadataBuilder,
)

from quantmla.kernels.layout import NoKernelLayout, PagedLayout
from quantmla.serving.kernel_pages import KernelPages
from quantmla.serving.paged_decode import paged_decode
from quantmla.serving.records import RecordLayout
from quantmla.serving.vllm.plugin_state import current_selection, mla_geometry, prompt_as_stored

logger = logging.getLogger("vllm.quantmla")
#: block sizes the kernels page by (vLLM's block = one kernel page)
BLOCK_SIZES = (16, 32, 64, 128)
_GATHER: contextvars.ContextVar[RecordLayout | None] = contextvars.ContextVar("quantmla_gather", default=None)
_LOGGED: set[str] = set()


def _has_kernel(scheme: str) -> bool:
    try:
        PagedLayout.for_scheme(scheme)
    except NoKernelLayout:
        return False
    return True


def _log_once(msg: str, *args) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.info(msg, *args)


class QuantMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's common MLA metadata (block table and lengths per decode request), decode one token per
    request; full CUDA graphs for decode when the scheme has a kernel (the torch path syncs)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        sel = current_selection()
        if sel is not None and not _has_kernel(sel.scheme):
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support


class QuantMLACUDABackend(FlashAttnMLABackend):
    @staticmethod
    def get_builder_cls():
        return FlashAttnMLAMetadataBuilder if current_selection() is None else QuantMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[QuantMLACUDAImpl]:
        return QuantMLACUDAImpl

    @staticmethod
    def get_supported_kernel_block_sizes():
        if current_selection() is None:
            return FlashAttnMLABackend.get_supported_kernel_block_sizes()
        return list(BLOCK_SIZES)


class QuantMLACUDAImpl(FlashAttnMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sel = current_selection()
        self.layout = None
        if sel is not None:
            self.layout = RecordLayout(sel.scheme, self.kv_lora_rank, self.qk_rope_head_dim, sel.group_size)
            self.kernel = _has_kernel(sel.scheme)
            _log_once("quantmla plugin: %s decode through %s", sel.scheme,
                      "quantmla's Triton kernels on the pages in place" if self.kernel
                      else "the torch path (no kernel for this scheme; no CUDA graphs)")  # fmt: skip
        self._pages: tuple[int, KernelPages] | None = None

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if self.layout is None:
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        if kv_cache.numel() == 0:
            return None
        slots = slot_mapping.flatten()[: kv_c_normed.shape[0]].long()
        r = k_pe.reshape(k_pe.shape[0], -1)
        if self.kernel:  # one fused launch (padding slots, -1, skipped)
            from quantmla.kernels.write import write_records

            return write_records(self.layout, kv_cache, slots, kv_c_normed, r)
        slots = torch.where(slots >= 0, slots, 0)  # padding (-1): into the null block, never read (no sync)
        self.layout.write_pages(kv_cache, slots, kv_c_normed, r)
        return None

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None):  # fmt: skip
        if self.layout is not None:  # the prompt's own tokens as the cache holds them
            kv_c_normed, k_pe = prompt_as_stored(self.layout, kv_c_and_k_pe_cache, attn_metadata, kv_c_normed, k_pe)
        return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                                   output_scale)  # fmt: skip

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        token = _GATHER.set(self.layout)  # None: vLLM's own gather
        try:
            return super()._compute_prefill_context(q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        finally:
            _GATHER.reset(token)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.layout is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        from quantmla.kernels.decode import mla_decode

        q_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        dec = attn_metadata.decode
        if not self.kernel:
            out = paged_decode(q_nope, q_pe, kv_c_and_k_pe_cache, self.layout, dec.block_table, dec.seq_lens,
                               self.scale)  # fmt: skip
            return out, None
        key = kv_c_and_k_pe_cache.data_ptr()
        if self._pages is None or self._pages[0] != key:
            self._pages = (key, KernelPages(kv_c_and_k_pe_cache, self.layout))
        return mla_decode(q_nope, q_pe, self._pages[1], dec.block_table, dec.seq_lens, self.scale)


def patch_kv_cache_spec() -> None:
    """Make ``MLAAttention.get_kv_cache_spec`` ask for record pages while the plugin is asked for."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    original = MLAAttention.get_kv_cache_spec
    if getattr(original, "_quantmla", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        sel = current_selection()
        if sel is None or spec is None:
            return spec
        backend = self.get_attn_backend()
        if not issubclass(backend, QuantMLACUDABackend):
            raise ValueError(
                f"quantmla serves its cache through FLASH_ATTN_MLA (vLLM's default on Hopper); attention backend"
                f" {backend.get_name()} cannot read it: leave attention_backend unset or set it to FLASH_ATTN_MLA"
            )
        if spec.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={spec.block_size}; quantmla's pages support {BLOCK_SIZES}")
        d_c, d_r = mla_geometry()
        lay = RecordLayout(sel.scheme, d_c, d_r, sel.group_size)
        return replace(spec, head_size=lay.record_bytes, dtype=torch.uint8)

    get_kv_cache_spec._quantmla = True
    MLAAttention.get_kv_cache_spec = get_kv_cache_spec


def gather_records(layout: RecordLayout, src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                   seq_starts=None) -> None:  # fmt: skip
    """vLLM's ``gather_and_maybe_dequant_cache`` for record pages: ``dst[i]`` (``[c | k^R]``) is token
    ``i`` of the batch's concatenated contexts, request ``token_to_seq[i]``, at position
    ``i - cu_seq_lens[seq] + seq_starts[seq]``."""
    n = int(num_tokens)
    if n == 0:
        return
    t = torch.arange(n, device=dst.device)
    seq = token_to_seq[:n].long()
    pos = t - cu_seq_lens[seq].long()
    if seq_starts is not None:
        pos = pos + seq_starts[seq].long()
    bs = src_cache.shape[1]
    slots = block_table[seq, pos // bs].long() * bs + pos % bs
    c, r = layout.unpack(layout.read_slots(src_cache, slots), torch.float32)
    dst[:n] = torch.cat([c, r], dim=-1).to(dst.dtype)


def patch_context_gather() -> None:
    """Route vLLM's prefill-context gather through :func:`gather_records` inside quantmla's layers."""
    from vllm import _custom_ops as ops

    original = ops.gather_and_maybe_dequant_cache
    if getattr(original, "_quantmla", False):
        return

    def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                                       kv_cache_dtype, scale, seq_starts=None):  # fmt: skip
        layout = _GATHER.get()
        if layout is None:
            return original(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype,
                            scale, seq_starts)  # fmt: skip
        return gather_records(layout, src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                              seq_starts)  # fmt: skip

    gather_and_maybe_dequant_cache._quantmla = True
    ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
