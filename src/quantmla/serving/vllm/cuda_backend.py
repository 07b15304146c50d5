"""quantmla's MLA backend for vLLM on CUDA (vLLM 0.26 and 0.33, Hopper): it takes the place of ``FLASH_ATTN_MLA``.

``FLASH_ATTN_MLA`` is vLLM's first MLA choice on sm_90, so the plugin overrides that registration.
While the plugin is not asked for (:mod:`quantmla.serving.vllm.selection`), every method defers to
vLLM's own classes: same metadata builder, same spec, same kernels. When it is asked for:

* :func:`patch_kv_cache_spec` makes every MLA layer ask for ``uint8`` pages of one
  :class:`~quantmla.formats.records.RecordLayout` record a token (324 bytes for C4R4 at 512 + 64),
  stored field-major in the page, so vLLM sizes its blocks from the record (vLLM 0.26 has no
  ``customize_spec``; 0.33 sizes pages from the same spec);
* ``do_kv_cache_update`` quantises and packs the new tokens into their slots, once, in one fused
  Triton launch (:func:`quantmla.kernels.write.write_records`; the torch path for ``fp8``/``c8r8``);
* decode reads the pages in place through quantmla's Triton kernels
  (:meth:`~quantmla.kernels.layout.PagedLatentStore.from_pages`, page strides of the engine's tensor); schemes
  the kernels do not cover (``fp8``, ``c8r8``) decode through the torch path without CUDA graphs,
  and the log says which ran;
* prefill attends its own new tokens as computed (vLLM's own path, as ``QuantizedLatentCache``'s
  prefill does), and its context (earlier chunks of a chunked prefill, prefix-cache hits) is gathered
  and dequantised from the pages by one fused Triton launch a layer (:mod:`quantmla.kernels.gather`; the
  torch unpacking for ``fp8``/``c8r8``) through :func:`patch_context_gather`, the window tokens from
  their shadows; the slots it reads are planned by the step's first layer
  (:mod:`quantmla.serving.vllm.step_plans`); vLLM 0.33 gathers a chunk for a run of requests (its request
  indices local to the chunk), so each chunk's window ends are that run's;
* a request adding a few tokens to its context (at most
  :data:`~quantmla.serving.vllm.short_extends.SHORT_EXTEND_TOKENS`: a chunked prompt's last piece) attends as
  that many decode rows, one kernel row a token (:mod:`quantmla.serving.vllm.short_extends`), as
  ``FLASH_ATTN_MLA`` sends such requests down its decode path;
* an export's per-layer codec (:mod:`quantmla.serving.layer_codecs`: write-side transforms, learned ranges, a
  format per layer; records padded to the largest) is bound per layer at its first write or read: the new tokens
  go through the layer's transforms (and RoPE order) before the fused write, the decode's queries through their
  compensation and its output back, a prefill's gathered context back from the stored space; learned ranges and
  formats without a kernel write and decode through the torch path (no full CUDA graphs then). Refused at engine
  start until its GPU test has run (``selection.CUDA_CODECS``);
* the sink and recent windows of each request are read unquantised from BF16 shadows
  (:mod:`quantmla.serving.vllm.windowing`), planned once a step by the metadata builder outside the
  CUDA graph; the fused write also writes the shadow rows, and the decode kernel reads the pages for
  ``[sink, n - recent)`` and the window rows in place as one more split of the same softmax.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field, replace

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.flashattn_mla import (
    FlashAttnMLABackend,
    FlashAttnMLAImpl,
    FlashAttnMLAMetadataBuilder,
)

from quantmla.formats.records import RecordLayout
from quantmla.kernels.gather import has_fused_gather
from quantmla.kernels.layout import PagedLatentStore, has_kernel
from quantmla.serving.layer_codecs import ServedLayer, runs_kernels
from quantmla.serving.paged_decode import paged_decode
from quantmla.serving.vllm.plugin_state import (
    cache_index_of,
    capture_sizes,
    current_selection,
    graph_min_batch,
    log_once,
    mla_geometry,
    served_layers_of,
)
from quantmla.serving.vllm.short_extends import SHORT_EXTEND_TOKENS
from quantmla.serving.vllm.step_plans import ContextChunk, StepPlans, context_runs, run_ends
from quantmla.serving.vllm.windowing import LayerWindows, WindowPlanning, window_config

#: block sizes the kernels page by (vLLM's block = one kernel page)
BLOCK_SIZES = (16, 32, 64, 128)
_GATHER: contextvars.ContextVar[ContextGather | None] = contextvars.ContextVar("quantmla_gather", default=None)


class QuantMLAMetadataBuilder(WindowPlanning, MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's common MLA metadata (block table and lengths per decode request) plus the step's window plan; full
    CUDA graphs for uniform decode batches (one token a request, or a speculative-decoding step's ``1 + k``: one
    launch of that many query tokens a request) when the scheme has a kernel (the torch path syncs)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    # short extends (a chunked prompt's last few tokens) attend as decode tokens, one kernel row each
    # (quantmla.serving.vllm.short_extends), as FLASH_ATTN_MLA sends them down its decode path
    query_len_support = QueryLenSupport.VARLEN
    reorder_batch_threshold = SHORT_EXTEND_TOKENS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs) -> None:
        sel = current_selection()
        cfg = window_config(sel)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, window_cfg=cfg, **kwargs)
        for layout in kernel_layouts(sel):
            if has_fused_gather(layout):  # else vLLM's first chunked prefill would wait for Triton's compiler
                from quantmla.kernels.gather import warm_gather

                warm_gather(layout, kv_cache_spec.block_size, cfg.enabled, device)
                log_once("quantmla plugin: the prefill-context gather compiled at start")

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        sel = current_selection()
        if sel is not None and not all_layers_run_kernels(sel):
            log_once("quantmla plugin: a layer's scheme has no kernel or learned ranges (torch write): no full CUDA"
                     " graphs for the decode")  # fmt: skip
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support


def plain_layout(sel) -> RecordLayout:
    """The record of a plain scheme (no per-layer codec) at the model's MLA widths."""
    d_c, d_r = mla_geometry()
    return RecordLayout(sel.scheme, d_c, d_r, sel.group_size)


def kernel_layouts(sel) -> list[RecordLayout]:
    """The distinct record layouts of the engine's layers that the Triton kernels read (none without a selection)."""
    if sel is None:
        return []
    served = served_layers_of(sel)
    if served is None:
        lay = plain_layout(sel)
        return [lay] if has_kernel(lay) else []
    return list(dict.fromkeys(lay.layout for lay in served if runs_kernels(lay)))


def all_layers_run_kernels(sel) -> bool:
    """Whether every layer writes and decodes through the kernels (the condition for full CUDA graphs)."""
    served = served_layers_of(sel)
    return has_kernel(plain_layout(sel)) if served is None else all(runs_kernels(lay) for lay in served)


class QuantMLACUDABackend(FlashAttnMLABackend):
    @staticmethod
    def get_builder_cls():
        return FlashAttnMLAMetadataBuilder if current_selection() is None else QuantMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[QuantMLACUDAImpl]:
        return QuantMLACUDAImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        if current_selection() is None:  # vLLM 0.33 passes the spec; 0.26 takes no argument
            spec = () if kv_cache_spec is None else (kv_cache_spec,)
            return FlashAttnMLABackend.get_supported_kernel_block_sizes(*spec)
        return list(BLOCK_SIZES)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """vLLM 0.33: whether a step may trim queries on the device only (adaptive draft verification); the window
        plan and the short extends' rows are made from the host's query lengths, so not while quantmla serves."""
        if current_selection() is not None:
            return False
        return super().supports_device_cpu_query_lens_mismatch()


class QuantMLACUDAImpl(FlashAttnMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sel = current_selection()
        self.layout = None
        self.windows = None
        self.kernel = False
        # a per-layer codec (write-side transforms, learned ranges, a format per layer): this layer's is bound at
        # its first cache write or read (its index from the KV cache it holds), records padded to the largest
        self.served = None if sel is None else served_layers_of(sel)
        self.layer: ServedLayer | None = None
        if sel is not None:
            if self.served is None:
                self._bind(RecordLayout(sel.scheme, self.kv_lora_rank, self.qk_rope_head_dim, sel.group_size))
                log_once("quantmla plugin: %s decode through %s", sel.scheme,
                          "quantmla's Triton kernels on the pages in place" if self.kernel
                          else "the torch path (no kernel for this scheme; no CUDA graphs)")  # fmt: skip
            else:
                self._bind(self.served[0].layout, kernel=all_layers_run_kernels(sel))
                log_once("quantmla plugin: the per-layer codec's layers decode through %s",
                         "the Triton kernels (transforms as matmuls around them)" if self.kernel
                         else "the Triton kernels where a layer's format has one and no learned ranges, else the"
                         " torch path")  # fmt: skip
            self.windows = LayerWindows.for_layer(sel, self.layout)
        self._pages: tuple[int, PagedLatentStore] | None = None
        # the decode graph of each captured batch replays the batches above the next captured size down
        sizes = capture_sizes()
        self.min_batches = {b: graph_min_batch(b, sizes) for b in sizes or ()}
        if sel is not None and self.kernel:
            log_once("quantmla plugin: each decode graph's KV splits sized for the batches vLLM pads to it (%s);"
                     " split partials in %s", "from its capture sizes" if sizes else "capture sizes unknown: half"
                     " its batch up", self.partial_dtype)  # fmt: skip

    def _bind(self, layout: RecordLayout, kernel: bool | None = None) -> None:
        """This layer's record layout, whether the kernels serve it, and the split partials' dtype: float16 for a
        quantised store (half the traffic between the splits and the combine; docs/notebook.md has the H200
        timings), float32 for BF16 records (fp16's range)."""
        self.layout = layout
        self.kernel = has_kernel(layout) if kernel is None else kernel
        self.partial_dtype = torch.float16 if layout.cache_scheme.quantized else torch.float32
        if self.windows is not None:
            self.windows.layout = layout  # its repairs read this layer's records

    def _served_layer(self, kv_cache: torch.Tensor) -> ServedLayer | None:
        """This layer's codec, on the cache's device (``None`` for a plain scheme): the engine's layer whose KV cache
        is ``kv_cache`` names its index (found once, at the first write or read, before any graph capture)."""
        if self.served is None or kv_cache.numel() == 0:  # an empty cache (vLLM's profile run): nothing to read
            return None
        if self.layer is None:
            self.layer = self.served[cache_index_of(kv_cache)].to(kv_cache.device)
            self._bind(self.layer.layout, kernel=runs_kernels(self.layer))
        return self.layer

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, *rest) -> None:
        # rest: vLLM 0.33's skip_scale (for its FP8 cache; records carry their own scales)
        if self.layout is None:
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                                              *rest)  # fmt: skip
        if kv_cache.numel() == 0:
            return None
        slots = slot_mapping.flatten()[: kv_c_normed.shape[0]].long()
        c, r = kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)
        layer = self._served_layer(kv_cache)
        ranges = None
        if layer is not None:  # as the layer stores them: through its transforms, the key in its channel order
            c, r = layer.stored_space(c, r)
            ranges = layer.ranges
        if self.kernel:  # one fused launch (padding slots, -1, skipped), the shadow rows included
            from quantmla.kernels.write import write_records

            step = None if self.windows is None else self.windows.step(kv_cache)
            shadow = {} if step is None else dict(shadow_rows=self.windows.shadow.rows, shadow_map=step.pool.map)
            write_records(self.layout, kv_cache, slots, c, r, **shadow)
            return None
        safe = torch.where(slots >= 0, slots, 0)  # padding (-1): into the null block, never read (no sync)
        self.layout.write_pages(kv_cache, safe, c, r, ranges=ranges)
        if self.windows is not None:
            self.windows.write(kv_cache, slots, c, r)
        return None

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        gather = None
        served = self._served_layer(kv_c_and_k_pe_cache)  # bound before its layout is read
        if self.layout is not None:
            step = getattr(attn_metadata, "windows", None)
            ends = None if step is None else step.seq_lens[attn_metadata.num_decodes :]
            gather = ContextGather(self.layout, attn_metadata.plans, self.windows if ends is not None else None,
                                   step, ends, fused=self.kernel and has_fused_gather(self.layout),
                                   runs=context_runs(attn_metadata.prefill), served=served)  # fmt: skip
        token = _GATHER.set(gather)  # None: vLLM's own gather
        try:
            return super()._compute_prefill_context(q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        finally:
            _GATHER.reset(token)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.layout is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        q_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        layer = self._served_layer(kv_c_and_k_pe_cache)
        if layer is None:
            return self._decode(q_nope, q_pe, kv_c_and_k_pe_cache, attn_metadata)
        # the queries in the layer's stored space (q A^-T, the RoPE query in its key's order), the output back
        dtype = q_nope.dtype
        q_nope, q_pe = (x.to(dtype) for x in layer.queries(q_nope, q_pe))
        out, lse = self._decode(q_nope, q_pe, kv_c_and_k_pe_cache, attn_metadata)
        return layer.output(out), lse

    def _decode(self, q_nope, q_pe, kv_c_and_k_pe_cache, attn_metadata):
        dec = attn_metadata.decode
        step = getattr(attn_metadata, "windows", None)
        if self.windows is not None and step is None:
            raise RuntimeError("quantmla windows: a decode step without a window plan")
        table, lens = dec.block_table, dec.seq_lens
        uniform = getattr(attn_metadata, "decode_query_len", 0)
        rows = getattr(attn_metadata, "decode_tokens", None)
        if self.kernel and uniform > 1:  # every decode request adds S tokens: one launch of S query tokens each
            log_once("quantmla plugin: decode steps whose requests all add the same several tokens (speculative"
                     " decoding's verification, vLLM's warm-up) attend in one launch of that many causal query tokens"
                     " a request")  # fmt: skip
            return self._kernel_decode(q_nope.unflatten(0, (-1, uniform)), q_pe.unflatten(0, (-1, uniform)),
                                       kv_c_and_k_pe_cache, table, lens, step)  # fmt: skip
        if rows is not None:  # short extends among the decodes: one row a token
            log_once("quantmla plugin: short extends attend as decode tokens (one kernel row a token)")
            table, lens = attn_metadata.plans.decode_rows(rows, table, lens)
        if not self.kernel:
            win, n_paged = {}, lens
            if self.windows is not None:
                wrows, count, start, n_paged = self.windows.decode_window(step, kv_c_and_k_pe_cache, table, lens)
                win = dict(window=wrows, window_len=count, paged_start=start)
            out = paged_decode(q_nope, q_pe, kv_c_and_k_pe_cache, self.layout, table, n_paged, self.scale, **win)
            return out, None
        return self._kernel_decode(q_nope, q_pe, kv_c_and_k_pe_cache, table, lens, step)

    def _min_batch(self, requests: int, tokens: int) -> int | None:
        """The fewest real requests a decode graph of ``requests`` requests of ``tokens`` tokens each replays (vLLM's
        capture sizes count tokens)."""
        lo = self.min_batches.get(requests * tokens)
        return None if lo is None else max(1, -(-lo // tokens))

    def _kernel_decode(self, q_nope, q_pe, kv_c_and_k_pe_cache, table, lens, step):
        """The Triton decode over the pages in place: queries ``[B, H, d]`` or ``[B, S, H, d]`` (``S`` causal
        query tokens a request, output ``[B * S, H, d_c]``)."""
        from quantmla.kernels.decode import mla_decode

        key = kv_c_and_k_pe_cache.data_ptr()
        if self._pages is None or self._pages[0] != key:
            self._pages = (key, PagedLatentStore.from_pages(kv_c_and_k_pe_cache, self.layout))
        shadow = None
        if self.windows is not None:  # the window rows read in place by the kernel (no gather)
            from quantmla.kernels.decode import ShadowWindow

            cfg = self.windows.cfg
            shadow = ShadowWindow(self.windows.shadow.rows, step.pool.map, cfg.sink, cfg.recent)
        o, lse = mla_decode(
            q_nope,
            q_pe,
            self._pages[1],
            table,
            lens.int(),
            self.scale,
            shadow=shadow,
            min_batch=self._min_batch(table.shape[0], q_nope.shape[1] if q_nope.dim() == 4 else 1),
            partial_dtype=self.partial_dtype,
        )
        rows = q_nope.shape[-2] * (q_nope.shape[1] if q_nope.dim() == 4 else 1)
        which = "sm_90a (quantmla.kernels.hopper)" if mla_decode.last_backend == "sm90" else "Triton"
        log_once("quantmla plugin: decode pages read by the %s kernel at %d query rows a request", which, rows)
        if o.dim() == 4:  # S query tokens a request: vLLM's token order (request-major)
            return o.flatten(0, 1), lse.flatten(0, 1)
        return o, lse


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
        served = served_layers_of(sel)
        if served is not None:  # a per-layer codec: every layer's record padded to the largest
            return replace(spec, head_size=served[0].layout.record_bytes, dtype=torch.uint8)
        return replace(spec, head_size=plain_layout(sel).record_bytes, dtype=torch.uint8)

    get_kv_cache_spec._quantmla = True
    MLAAttention.get_kv_cache_spec = get_kv_cache_spec


@dataclass(frozen=True)
class ContextGather:
    """How a layer's prefill context reads its pages: the records, and with windows the shadows of the
    tokens in their request's window (``ends``: the prefill requests' lengths after the step)."""

    layout: RecordLayout
    plans: StepPlans  # the step's plans: the slots made by its first layer, reused by the others
    windows: LayerWindows | None = None
    step: object | None = None
    ends: torch.Tensor | None = None
    fused: bool = False  # through the fused Triton gather (:mod:`quantmla.kernels.gather`)
    runs: dict[int, slice] = field(default_factory=dict)  # vLLM 0.33's chunks' request runs (step_plans.context_runs)
    served: ServedLayer | None = None  # a per-layer codec's layer: the rows back from its stored space


def gather_records(gather: ContextGather, src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                   seq_starts=None) -> None:  # fmt: skip
    """vLLM's ``gather_and_maybe_dequant_cache`` for record pages: ``dst[i]`` (``[c | k^R]``) is token
    ``i`` of the batch's concatenated contexts, request ``token_to_seq[i]``, at position
    ``i - cu_seq_lens[seq] + seq_starts[seq]``; tokens in their request's window from their shadows."""
    layout = gather.layout
    n = int(num_tokens)
    if n == 0:
        return
    window, ends = None, None
    if gather.windows is not None:
        window, ends = gather.windows.cfg, run_ends(gather.ends, gather.runs, cu_seq_lens)
    chunk = ContextChunk(block_table, cu_seq_lens, token_to_seq, n, src_cache.shape[1], seq_starts, window, ends)
    plan = gather.plans.context(chunk)
    slots, wanted = plan.slots, plan.wanted
    if gather.fused and dst.dtype == torch.bfloat16 and dst.is_contiguous():
        from quantmla.kernels.gather import gather_rows

        shadow = {} if wanted is None else dict(wanted=wanted, shadow_rows=gather.windows.shadow.rows,
                                                shadow_map=gather.step.pool.map)  # fmt: skip
        log_once("quantmla plugin: prefill context read by the fused Triton gather")
        gather_rows(layout, src_cache, slots, dst[:n], **shadow)
    else:
        log_once("quantmla plugin: prefill context read by the torch path (%s, %s)", layout.scheme, dst.dtype)
        c, r = layout.unpack(layout.read_slots(src_cache, slots), torch.float32)
        x = torch.cat([c, r], dim=-1)
        if wanted is not None:
            x = gather.windows.shadow.lookup(gather.step.pool, slots, wanted, x)
        dst[:n] = x.to(dst.dtype)
    if gather.served is not None and (gather.served.transformed or gather.served.rope_order is not None):
        # records and shadows hold the stored space (c A_c, k^R A_R, the key in the calibration's order)
        c, r = gather.served.from_stored(*dst[:n].split([layout.kv_lora_rank, layout.rope_dim], dim=-1))
        dst[:n] = torch.cat([c, r], dim=-1).to(dst.dtype)


def patch_context_gather() -> None:
    """Route vLLM's prefill-context gather through :func:`gather_records` inside quantmla's layers."""
    from vllm import _custom_ops as ops

    original = ops.gather_and_maybe_dequant_cache
    if getattr(original, "_quantmla", False):
        return

    def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                                       kv_cache_dtype, scale, seq_starts=None):  # fmt: skip
        gather = _GATHER.get()
        if gather is None:
            return original(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype,
                            scale, seq_starts)  # fmt: skip
        return gather_records(gather, src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                              seq_starts)  # fmt: skip

    gather_and_maybe_dequant_cache._quantmla = True
    ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
