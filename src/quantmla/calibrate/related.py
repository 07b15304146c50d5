"""The seed papers' methods whose result is a cache codec (``raq``, ``blockgtq``, ``rolaq``), and ``raq-alloc``
(RAQ-MLA's transforms with the formats allocated across layers, :mod:`~quantmla.calibrate.layer_alloc`).

Their parameters cannot all be fused into the weights (RAQ-MLA's general ``A_c`` after the norm and ``A_R``
after RoPE, RoLaQ's learned ranges) or are formats that differ by layer (Block-GTQ's widths per RoPE pair), so
the result is a :class:`~quantmla.formats.codec.ModelCodec` that the cache, the decode-cache simulation and the
export carry; RAQ-MLA and Block-GTQ leave the weights as they are, RoLaQ's rotation is fused into them.
Each layer's report row holds the held-out values the choice was made on.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from quantmla.calibrate import rolaq
from quantmla.calibrate.layer_alloc import allocate, layer_menu, menu_options
from quantmla.calibrate.methods import LearnConfig
from quantmla.calibrate.objectives import collect, latent_gain
from quantmla.calibrate.raq import RaqConfig, fit_path
from quantmla.calibrate.rope_energy import allocated_formats, layer_block_scores, rope_block_scores
from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.scheme import PathFormat, parse_scheme

logger = logging.getLogger(__name__)
CODEC_METHODS = ("raq", "blockgtq", "rolaq", "raq-alloc")


def check_codec_scheme(method: str, scheme: str) -> None:
    """Raise unless ``scheme`` is one ``method`` calibrates (Block-GTQ: a uniform TQ-MSE RoPE key, ``r<b>t``,
    whose width is the mean the allocation keeps)."""
    s = parse_scheme(scheme)
    c = s.content
    if method == "rolaq" and not (c.kind == "int" and not c.turbo and c.channel_bits is None and c.page is None
                                  and c.clip is None):  # fmt: skip
        raise ValueError(
            f"method rolaq learns the ranges of affine per-token groups: scheme {scheme!r} needs a plain integer "
            "content path c<b> or c<b>g<n> (e.g. c2r4, c2g128r4)"
        )
    if method == "blockgtq" and not (s.rope.turbo and s.rope.channel_bits is None):
        raise ValueError(
            f"method blockgtq allocates the RoPE key's widths in TQ-MSE: scheme {scheme!r} needs a uniform TQ-MSE "
            "RoPE path r<b>t, whose b is the mean width (e.g. c4r3t, c2g128q94r4t)"
        )


def fit_codec(model, adapter, modules, train_w, val_w, cfg, progress: bool, long_windows=None, inputs=None,
              alloc_fits=None):  # fmt: skip
    """``(codec, per-layer report rows, content transforms to fuse, allocation report)`` of ``cfg.method`` (one
    of :data:`CODEC_METHODS`) on ``model``; the transforms are ``{}`` except for RoLaQ's rotations, the
    allocation report ``None`` except for ``raq-alloc``.

    ``long_windows``: ``(train, held-out)`` windows at the served context (``cfg.model_seq_len``), on which
    RAQ-MLA fits its post-RoPE transform: a key after RoPE depends on its position, and a transform fitted on
    short windows has not seen the angles of the later positions; ``raq-alloc`` measures its held-out KL on
    the held-out ones.

    ``inputs``: the attention inputs of ``modules`` (a :class:`~quantmla.measure.layer_inputs.StreamedInputs` at
    their layer), ``None``: ``model`` run from the embedding. ``raq-alloc`` allocates through the whole model
    and needs ``None``; ``alloc_fits``: its per-layer fits from :func:`raq_alloc_fits` (layer by layer, beforehand),
    ``None``: fitted here."""
    scheme = parse_scheme(cfg.scheme)
    rows, layers, fused = [], {}, {}
    source = model if inputs is None else inputs
    if cfg.method == "raq-alloc" and inputs is not None:
        raise ValueError("raq-alloc allocates formats by the whole model's held-out KL: it needs the model in memory")
    if cfg.method == "blockgtq":
        d_r = modules[0][1].qk_rope_head_dim
        pairs = adapter.rope_layout(model.config).cache_pairs(d_r)
        if inputs is None:
            scores = rope_block_scores(model, train_w, cfg.batch_size)
        else:
            scores = {idx: layer_block_scores(inputs, idx, train_w, cfg.batch_size, pairs) for idx, _ in modules}
        formats = allocated_formats(scores, pairs, scheme.rope.bits)
        for idx, _ in modules:
            fmt = formats[idx]
            layers[idx] = LayerCodec(PathCodec(scheme.content), PathCodec(fmt))
            rows.append({"layer": idx, "rope": {"scores": scores[idx].tolist(), "format": fmt.spec}})
    elif cfg.method == "rolaq":
        learn_cfg = LearnConfig(cfg.steps, cfg.lr)
        for idx, attn in tqdm(modules, desc=f"calibrate rolaq {cfg.scheme}", unit="layer", disable=not progress):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + idx)
            train = collect(source, idx, train_w, cfg.batch_size)
            val = collect(source, idx, val_w, cfg.batch_size)
            g = latent_gain(adapter, attn)
            fused[idx], ratios, gains, info = rolaq.fit_layer(train, val, adapter, attn, g, scheme.content,
                                                              cfg.group_size, learn_cfg, gen)  # fmt: skip
            content = PathCodec(scheme.content, clip_ratio=ratios, gain=gains)
            layers[idx] = LayerCodec(content, PathCodec(scheme.rope))
            rows.append({"layer": idx, "content": info, "rope": {"format": scheme.rope.spec}})
            del train, val
    elif cfg.method == "raq-alloc":
        if alloc_fits is None:
            alloc_fits = raq_alloc_fits(model, modules, train_w, val_w, cfg, progress, long_windows)
        codec, rows, report = _raq_alloc(model, adapter, modules, val_w, cfg, progress, long_windows, alloc_fits)
        return codec, rows, fused, report
    else:
        fits = _raq_fits(source, modules, train_w, val_w, cfg, scheme.content, scheme.rope, cfg.paths, progress,
                         long_windows)  # fmt: skip
        for (idx, _), paths in zip(modules, fits, strict=True):
            layers[idx] = LayerCodec(paths["content"][0], paths["rope"][0])
            rows.append({"layer": idx, **{p: info for p, (_, info) in paths.items()}})
    name = f"{cfg.method} {scheme.name}"
    return ModelCodec(name, tuple(layers[i] for i in sorted(layers))), rows, fused, None


def _raq_fits(model, modules, train_w, val_w, cfg, content: PathFormat, rope: PathFormat, paths, progress,
              long_windows) -> list[dict[str, tuple[PathCodec, dict]]]:  # fmt: skip
    """Per layer (``modules`` order) and path, RAQ-MLA's fit ``(path codec, report)`` at the given formats; a
    path not in ``paths`` keeps its format alone."""
    raq = RaqConfig()
    fmts = {"content": content, "rope": rope}
    out = []
    spec = f"c{content.spec}r{rope.spec}" + ("" if set(paths) == {"content", "rope"} else f" {'+'.join(paths)}")
    for idx, _ in tqdm(modules, desc=f"calibrate raq {spec}", unit="layer", disable=not progress):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + idx)
        data = {"content": (train_w, val_w), "rope": long_windows or (train_w, val_w)}
        layer = {}
        for path, fmt in fmts.items():
            if path in paths:
                train, val = (collect(model, idx, w, cfg.batch_size) for w in data[path])
                codec, info = fit_path(path, train, val, fmt, cfg.group_size, raq, gen)
                info["seq_len"] = data[path][0].shape[1]
                layer[path] = (codec, info)
                del train, val
            else:
                layer[path] = (PathCodec(fmt), {"init": "original"})
        out.append(layer)
    return out


def raq_alloc_fits(source, modules, train_w, val_w, cfg, progress, long_windows) -> dict[tuple[str, str], list]:
    """``raq-alloc``'s fits: RAQ-MLA's at every format of :func:`~quantmla.calibrate.layer_alloc.layer_menu`,
    ``{(path, format spec): [(path codec, report) per module]}``. ``source``: the model, or the attention inputs of
    ``modules`` (:class:`~quantmla.measure.layer_inputs.StreamedInputs`): each fit depends on its layer alone (its
    generator is seeded by the layer), so layer by layer gives the same fits."""
    scheme = parse_scheme(cfg.scheme)
    content, rope = layer_menu(scheme)
    fitted: dict[tuple[str, str], list] = {}
    for fmt in content:  # a content fit does not depend on the RoPE key's format, nor a RoPE fit on the latent's
        if "content" in cfg.paths:
            fits = _raq_fits(source, modules, train_w, val_w, cfg, fmt, scheme.rope, ("content",), progress, None)
            fitted["content", fmt.spec] = [f["content"] for f in fits]
    for fmt in rope:
        if "rope" in cfg.paths:
            fits = _raq_fits(source, modules, train_w, val_w, cfg, scheme.content, fmt, ("rope",), progress,
                             long_windows)  # fmt: skip
            fitted["rope", fmt.spec] = [f["rope"] for f in fits]
    return fitted


def _raq_alloc(model, adapter, modules, val_w, cfg, progress, long_windows, fitted):
    """The formats allocated across layers (:func:`~quantmla.calibrate.layer_alloc.allocate`) within the scheme's
    bytes, from :func:`raq_alloc_fits`' ``fitted``."""
    scheme = parse_scheme(cfg.scheme)
    content, rope = layer_menu(scheme)
    dims = adapter.dims(model.config)
    opts = menu_options(content, rope, dims.kv_lora_rank, dims.rope_dim, cfg.group_size)
    per_layer = []
    for i in range(len(modules)):
        row = []
        for nbytes, cf, rf in opts:
            c = fitted["content", cf.spec][i][0] if ("content", cf.spec) in fitted else PathCodec(cf)
            r = fitted["rope", rf.spec][i][0] if ("rope", rf.spec) in fitted else PathCodec(rf)
            row.append((nbytes, LayerCodec(c, r)))
        per_layer.append(row)
    budget = scheme.bytes_per_token(dims.kv_lora_rank, dims.rope_dim, cfg.group_size)
    windows = long_windows[1] if long_windows is not None else val_w
    name = f"raq-alloc {scheme.name}"
    codec, report = allocate(model, per_layer, budget, windows, cfg.group_size, cfg.sink, cfg.recent,
                             cfg.batch_size, name, progress)  # fmt: skip
    logger.info("raq-alloc: per-layer schemes %s (%.4g of %.4g bytes a token)", ", ".join(report["schemes"]),
                report["bytes_per_token"], budget)  # fmt: skip
    rows = []
    for i, ((idx, _), lc) in enumerate(zip(modules, codec.layers, strict=True)):
        row = {"layer": idx, "scheme": lc.scheme.name}
        for (path, spec), fits in fitted.items():
            row.setdefault(path, {})[spec] = fits[i][1]
        rows.append(row)
    return codec, rows, report
