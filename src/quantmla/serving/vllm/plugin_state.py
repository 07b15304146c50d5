"""The plugin's view of the running vLLM engine: the selection (resolved once, logged once) and the
model's MLA geometry. Imports vLLM lazily."""

from __future__ import annotations

import logging
import re

import torch

from quantmla.formats.scheme import parse_scheme
from quantmla.serving.vllm.selection import ROPE_ORDER_AS_VLLM, Selection, check_engine, select

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it
_RESOLVED: dict[int, Selection | None] = {}
_LOGGED: set[str] = set()


def log_once(msg: str, *args) -> None:
    """``logger.info`` once per process for each message (every layer's impl reaches the same lines)."""
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.info(msg, *args)


def _config():
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def current_selection() -> Selection | None:
    """The scheme the running engine serves, or ``None`` (plugin off). Logged once per engine config."""
    cfg = _config()
    key = id(cfg) if cfg is not None else 0
    if key in _RESOLVED:
        return _RESOLVED[key]
    model = getattr(getattr(cfg, "model_config", None), "model", None)
    sel = select(getattr(cfg, "additional_config", None), model)
    if sel is not None and cfg is not None:
        import vllm
        from vllm.platforms import current_platform

        check_engine(sel, cfg, "cpu" if current_platform.is_cpu() else "cuda", vllm.__version__)
    if cfg is None and sel is None and _RESOLVED:  # no config in scope: what the engine resolved before
        return next(reversed(_RESOLVED.values()))
    _RESOLVED[key] = sel
    if cfg is not None:
        if sel is None:
            logger.info("quantmla plugin: not asked for (no additional_config['quantmla'], QUANTMLA_SCHEME or"
                        " quantmla.json); vLLM's own MLA backend runs unchanged")  # fmt: skip
        else:
            quantised = parse_scheme(sel.scheme).quantized
            sink, recent = sel.windows
            windows = f"sink {sink} + recent {recent} tokens unquantised" if quantised else "none (unquantised)"
            logger.info("quantmla plugin: serving the MLA cache as %s, group %d (from %s); windows: %s", sel.scheme,
                        sel.group_size, sel.source, windows)  # fmt: skip
    return sel


_SERVED: dict[str, list] = {}


def served_layers_of(sel: Selection) -> list | None:
    """The per-layer codec of the selected export as the engine serves it (one
    :class:`~quantmla.serving.layer_codecs.ServedLayer` a cache layer, records padded to the largest), read once and
    logged; ``None`` for a plain scheme."""
    if sel.codec_dir is None:
        return None
    d_c, d_r = mla_geometry()
    key = f"{sel.codec_dir}:{d_c}:{d_r}"
    if key not in _SERVED:
        from quantmla.formats.export import read_codec, read_meta
        from quantmla.serving.layer_codecs import interleaved_to_rotate_half, served_layers

        meta = read_meta(sel.codec_dir)
        codec = read_codec(sel.codec_dir, meta)
        hf = getattr(getattr(_config(), "model_config", None), "hf_text_config", None)
        n_layers = getattr(hf, "num_hidden_layers", None)
        if n_layers is not None and len(codec.layers) != n_layers:
            raise ValueError(f"quantmla: the codec of {sel.codec_dir} has {len(codec.layers)} layers; the model has"
                             f" {n_layers}")  # fmt: skip
        # vLLM holds the RoPE key in interleaved pairs; where quantmla's cache (the calibration) holds it
        # rotate-half, the key and its query are put in that order first
        same = getattr(hf, "model_type", None) in ROPE_ORDER_AS_VLLM
        order = None if same else interleaved_to_rotate_half(d_r)
        layers = _SERVED[key] = served_layers(codec, d_c, d_r, sel.group_size, order)
        fitted = [i for i, lay in enumerate(layers) if lay.transformed]
        ranged = [i for i, lay in enumerate(layers) if lay.ranges is not None]
        formats = sorted({lay.layout.scheme for lay in layers})
        logger.info("quantmla plugin: serving the per-layer codec of %s (%s): write-side transforms in layers %s,"
                    " learned ranges in %s, formats %s; records of %d bytes", sel.codec_dir, codec.name, fitted,
                    ranged, formats, layers[0].layout.record_bytes)  # fmt: skip
    return _SERVED[key]


def mla_geometry() -> tuple[int, int]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of the model being served."""
    cfg = _config()
    hf = getattr(getattr(cfg, "model_config", None), "hf_text_config", None)
    if hf is None or not hasattr(hf, "kv_lora_rank"):
        return 512, 64
    return int(hf.kv_lora_rank), int(hf.qk_rope_head_dim)


def capture_sizes() -> list[int] | None:
    """The batch sizes vLLM captures CUDA graphs for (``compilation_config.cudagraph_capture_sizes``; one
    decode token a request, so requests), or ``None`` outside an engine's config."""
    comp = getattr(_config(), "compilation_config", None)
    sizes = getattr(comp, "cudagraph_capture_sizes", None)
    return sorted(int(s) for s in sizes) if sizes else None


def graph_min_batch(batch: int, sizes: list[int] | None) -> int | None:
    """The fewest real requests vLLM replays in the decode graph captured for ``batch``: it pads a batch to
    the smallest captured size that holds it, so one more than the next smaller captured size (41 for the
    graph of 48 under the default sizes 1, 2, 4, 8, 16, ...). ``None`` without the sizes."""
    if sizes is None:
        return None
    return max((s for s in sizes if s < batch), default=0) + 1


def cache_index_of(kv_cache: torch.Tensor) -> int:
    """The cache index (decoder layer) of the engine's MLA layer whose KV cache tensor is ``kv_cache``, from vLLM's
    forward context (its layers by name, ``...layers.<i>...``)."""
    from vllm.forward_context import get_forward_context

    for name, module in get_forward_context().no_compile_layers.items():
        kv = getattr(module, "kv_cache", None)
        kv = kv[0] if isinstance(kv, list | tuple) and kv else kv
        if isinstance(kv, torch.Tensor) and kv.numel() and kv.data_ptr() == kv_cache.data_ptr():
            m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if m is None:
                raise RuntimeError(f"quantmla: the MLA layer {name!r} names no decoder layer index")
            return int(m.group(1))
    raise RuntimeError("quantmla: no MLA layer of this engine holds this KV cache (a per-layer codec needs its index)")
