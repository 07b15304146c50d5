"""The sink and recent windows inside vLLM: one plan per engine step, the shadows per layer.

The metadata builder (:class:`WindowPlanning`, mixed into both backends' builders) plans the step's
shadows on the host (:meth:`quantmla.serving.windows.WindowPool.plan`) and hands the pool to the
layers through the step's metadata (:class:`QuantMLAMetadata`). Each layer (:class:`LayerWindows`)
holds its shadow rows, writes the new tokens into them and reads the decode window (and, on CUDA,
the prefill context's window tokens) from them.

The shadow rows come out of the KV budget: with ``kv_cache_memory_bytes`` given, each layer takes its
rows' bytes off it before vLLM sizes its blocks (otherwise vLLM's memory profile sees them as model
memory), so the engine's blocks plus the windows fill the same budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata

from quantmla.formats.records import RecordLayout
from quantmla.formats.scheme import parse_scheme
from quantmla.formats.windows import WindowPolicy
from quantmla.serving.vllm.host_tables import host_block_table, host_seq_lens
from quantmla.serving.vllm.plugin_state import log_once
from quantmla.serving.vllm.selection import Selection
from quantmla.serving.vllm.short_extends import DecodeTokens, decode_tokens, uniform_query_len
from quantmla.serving.vllm.step_plans import StepPlans
from quantmla.serving.windows import ShadowRows, WindowPool

logger = logging.getLogger("vllm.quantmla")


def window_config(sel: Selection | None) -> WindowPolicy:
    """The windows the selection asks for (none for an unquantised scheme: every token is BF16 already)."""
    if sel is None or not parse_scheme(sel.scheme).quantized or sel.windows is None:
        return WindowPolicy(0, 0)
    return WindowPolicy(*sel.windows)


@dataclass(frozen=True)
class WindowStep:
    """What a layer needs of the step's windows: the planned pool and the batch's lengths after the step
    (``seq_lens [num_reqs]``)."""

    pool: WindowPool
    seq_lens: torch.Tensor


@dataclass
class QuantMLAMetadata(MLACommonMetadata):
    """vLLM's MLA metadata with the step's windows and plans; any latent and RoPE widths (quantmla's decode reads
    them all, where vLLM's common metadata checks for DeepSeek's 512 + 64)."""

    windows: WindowStep | None = None
    decode_tokens: DecodeTokens | None = None  # short extends among the decodes (None: one token each)
    decode_query_len: int = 0  # > 1: every decode request adds this many tokens (one launch of that many queries)
    plans: StepPlans | None = None  # what every layer reads of the step, made once (a new one a step)

    def __post_init__(self) -> None:
        pass  # (MLACommonMetadata's only check: a head size its kernels take)


class WindowPlanning:
    """Mixin for an ``MLACommonMetadataBuilder``: builds :class:`QuantMLAMetadata`, plans the windows and
    maps the step's short extends to decode rows (:mod:`quantmla.serving.vllm.short_extends`) when the
    builder's ``reorder_batch_threshold`` is above 1."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, window_cfg: WindowPolicy, **kwargs):
        kwargs.setdefault("metadata_cls", QuantMLAMetadata)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.window_pool = None
        # without speculative decoding every scheduled token is kept: the host upper bound is the length
        self.exact_lengths = vllm_config.speculative_config is None
        if window_cfg.enabled:
            blocks = vllm_config.cache_config.num_gpu_blocks
            if blocks is None:
                raise RuntimeError("quantmla windows: vLLM built the attention metadata before sizing its blocks")
            max_reqs = vllm_config.scheduler_config.max_num_seqs
            self.window_pool = WindowPool(window_cfg, blocks * kv_cache_spec.block_size, max_reqs, device,
                                          extra=speculative_tokens(vllm_config))  # fmt: skip

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].numpy()
        threshold = self.reorder_batch_threshold
        pool = self.window_pool
        if pool is not None:
            before = pool.misses
            # host copies of the step's table and lengths: no wait for the GPU (quantmla.serving.vllm.host_tables)
            table, lens = host_block_table(cm.block_table_tensor, n), host_seq_lens(cm, n, self.exact_lengths)
            q = qsl[1:] - qsl[:-1]
            bs = self.kv_cache_spec.block_size
            short = (q > 1) & (q <= threshold)  # short extends: decode tokens if their windows have shadows
            granted = pool.plan(table, lens, q, bs, short=short)
            if not granted[short].all():
                threshold = int(q[short & ~granted].min()) - 1
                log_once(
                    "quantmla windows: a step whose shadow pool could not hold the short extends' windows:"
                    " their requests attended as prefills (windows relative to the step's end)"
                )
            if pool.misses > before:
                logger.warning("quantmla windows: %d window tokens had no unquantised copy (a prefix-cache hit, or"
                               " a request long unscheduled) and are read as stored; %d so far",
                               pool.misses - before, pool.misses)  # fmt: skip
        md = self._build_split_at(threshold, common_prefix_len, cm, fast_build)
        if pool is not None:
            md.windows = WindowStep(pool, cm.seq_lens[:n])
        md.decode_query_len = uniform_query_len(qsl, md.num_decodes)  # the kernels' path: one launch of S tokens
        md.decode_tokens = decode_tokens(qsl, md.num_decodes)  # the others' (host; uploaded when read): a row a token
        md.plans = StepPlans()
        return md

    def _build_split_at(self, threshold: int, common_prefix_len, cm, fast_build: bool):
        """vLLM's build with the decode requests those of at most ``threshold`` new tokens this step (vLLM's
        builder reads its ``reorder_batch_threshold`` for the split; the batch stays ordered by it)."""
        default = self.reorder_batch_threshold
        self.reorder_batch_threshold = threshold
        try:
            return super().build(common_prefix_len, cm, fast_build)
        finally:
            self.reorder_batch_threshold = default


def speculative_tokens(vllm_config) -> int:
    """Draft tokens a request verifies a step (0 without speculative decoding): the earlier query tokens of a
    verification step read windows up to that many positions before the step's, so the window pool holds that
    many more positions a request and every such step attends as decode tokens."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def current_window_step() -> WindowStep | None:
    """The running step's :class:`WindowStep`, from vLLM's forward context (``do_kv_cache_update`` is not
    handed the metadata)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # micro-batches: the first one's (they share the pool)
        md = md[0] if md else None
    if isinstance(md, dict):
        md = next((m for m in md.values() if isinstance(m, QuantMLAMetadata)), None)
    return getattr(md, "windows", None)


class LayerWindows:
    """One MLA layer's windows: its shadow rows (taken off the KV budget) and what it reads from them."""

    def __init__(self, cfg: WindowPolicy, layout: RecordLayout, vllm_config, dtype: torch.dtype, device=None) -> None:
        self.cfg, self.layout = cfg, layout
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        width = layout.kv_lora_rank + layout.rope_dim
        self.shadow = ShadowRows(cfg, max_reqs, width, dtype, device, extra=speculative_tokens(vllm_config))
        cache = vllm_config.cache_config
        budget = getattr(cache, "kv_cache_memory_bytes", None)
        if budget is not None:
            if budget <= self.shadow.nbytes:
                raise ValueError(
                    f"kv_cache_memory_bytes={budget} cannot hold the windows' {self.shadow.nbytes} bytes for this"
                    f" layer ({max_reqs} requests, max_num_seqs); raise it or lower max_num_seqs"
                )
            cache.kv_cache_memory_bytes = budget - self.shadow.nbytes
        log_once(f"quantmla windows: sink {cfg.sink} + recent {cfg.recent} tokens of each request unquantised;"
                 f" {self.shadow.nbytes / 2**20:.2f} MiB a layer for {max_reqs} requests (max_num_seqs), taken off"
                 " the KV budget")  # fmt: skip

        self._pool: WindowPool | None = None

    @classmethod
    def for_layer(cls, sel: Selection, layout: RecordLayout) -> LayerWindows | None:
        """The windows of an MLA layer being built (vLLM's current config, default device), or ``None``
        when the selection asks for none."""
        cfg = window_config(sel)
        if not cfg.enabled:
            return None
        from vllm.config import get_current_vllm_config

        vcfg = get_current_vllm_config()
        return cls(cfg, layout, vcfg, vcfg.model_config.dtype, torch.get_default_device())

    def read(self, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The records of ``slots`` as stored, ``[N, d_c + d_r]`` in the shadows' dtype."""
        c, r = self.layout.unpack(self.layout.read_slots(pages, slots), self.shadow.rows.dtype)
        return torch.cat([c, r], dim=-1)

    def step(self, pages: torch.Tensor) -> WindowStep | None:
        """The running step's windows (``None`` in a step without a plan, e.g. vLLM's memory profile); the
        first step of a pool registers this layer's repair with it."""
        step = current_window_step()
        if step is not None and step.pool is not self._pool:
            step.pool.register(id(self), lambda rows, slots: self.shadow.repair(lambda s: self.read(pages, s), rows,
                                                                                   slots))  # fmt: skip
            self._pool = step.pool
        return step

    def write(self, pages: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> None:
        """The step's new tokens into their shadows."""
        step = self.step(pages)
        if step is not None:
            self.shadow.write(step.pool, slots, c, r)

    def decode_window(self, step: WindowStep, pages, block_table, seq_lens):
        """``(window [B, W, d], window_len, paged_start, n_paged)`` of the step's decode requests."""
        return self.shadow.window(step.pool, pages, block_table, seq_lens)
