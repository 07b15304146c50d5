"""``quantmla.calibrate``: calibrate, fuse and export, one layer at a time."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from quantmla.calibrate.combined import pick, undo_maps
from quantmla.calibrate.methods import (
    ORIGINAL,
    LearnConfig,
    content_transform,
    mean_layer_loss,
    rope_transform,
)
from quantmla.calibrate.model_level import ModelLevelConfig, refine
from quantmla.calibrate.objectives import collect, content_loss, latent_gain, rope_loss
from quantmla.calibrate.related import CODEC_METHODS, check_codec_scheme, fit_codec
from quantmla.formats.codec import ModelCodec
from quantmla.formats.export import META_FORMAT, METHODS, write_codec, write_meta
from quantmla.formats.scheme import parse_scheme
from quantmla.models.adapter import get_adapter
from quantmla.models.latent import disable_latent_attention, enable_latent_attention, is_latent_attention_enabled
from quantmla.transforms.fuse import ContentTransform, RopeTransform, fuse_content, fuse_rope, original_basis

logger = logging.getLogger(__name__)
PATHS = ("content", "rope")
#: the methods that run QuantMLA's layer and model stages (quantmla-raq: then RAQ-MLA's write-side transforms)
QUANTMLA_METHODS = ("quantmla", "quantmla-raq")
LAYER_STAGE_VERSION = 3  # 2: the original basis among every method's candidates; 3: one random stream per layer


@dataclass(frozen=True)
class CalibrationConfig:
    scheme: str = "c4r4"
    method: str = "quantmla"
    group_size: int = 64
    steps: int = 300
    lr: float = 5e-3
    num_seqs: int = 128
    val_seqs: int = 32
    seq_len: int = 512
    batch_size: int = 4
    paths: tuple[str, ...] = PATHS  # which paths get a transform (the ablation switches them)
    sink: int = 4
    recent: int = 128
    seed: int = 0
    model_steps: int = 150  # quantmla's model-level stage (0: layer objectives only)
    model_lr: float = 1e-3
    #: Adam's rate for the content rotations' generators in the model-level stage (None: model_lr scaled by
    #: the latent's width, ``ModelLevelConfig.rotation_rate``)
    model_rotation_lr: float | None = None
    model_objective: str = "kl"
    #: tokens per sequence of the model-level stage (None: seq_len): consecutive calibration windows joined, so
    #: the stage sees the cache at the context it will serve (the layer stage stays at seq_len)
    model_seq_len: int | None = None
    #: tokens per sequence on which RAQ-MLA's post-RoPE transform is fitted (raq, quantmla-raq; None:
    #: model_seq_len, then seq_len): a key after RoPE depends on its position, so a transform fitted on short
    #: windows has not seen the angles of later positions
    rope_fit_seq_len: int | None = None

    def __post_init__(self) -> None:
        s = parse_scheme(self.scheme)
        if not s.quantized:
            raise ValueError(f"scheme={self.scheme!r} does not quantise: nothing to calibrate")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; valid: {', '.join(METHODS)}")
        if self.method in CODEC_METHODS:
            check_codec_scheme(self.method, self.scheme)
        bad = [p for p in self.paths if p not in PATHS]
        if bad:
            raise ValueError(f"paths {bad}; valid: {PATHS}")
        for name in ("num_seqs", "val_seqs", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        LearnConfig(self.steps, self.lr)
        self.model_level()
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be >= 0")
        for name in ("model_seq_len", "rope_fit_seq_len"):
            m = getattr(self, name)
            if m is not None and (
                m < self.seq_len
                or m % self.seq_len
                or (self.num_seqs * self.seq_len) % m
                or (self.val_seqs * self.seq_len) % m
            ):
                raise ValueError(
                    f"{name}={m}: a multiple of seq_len={self.seq_len} that divides the {self.num_seqs} "
                    f"calibration and {self.val_seqs} held-out sequences' tokens (e.g. {self.seq_len * 2})"
                )

    def model_level(self) -> ModelLevelConfig:
        """The model-level stage's configuration."""
        return ModelLevelConfig(
            self.model_steps, self.model_lr, self.batch_size, objective=self.model_objective,
            rotation_lr=self.model_rotation_lr,
        )  # fmt: skip

    def layer_key(self) -> tuple:
        """The fields the layer stage depends on (everything but the windows and the model-level stage)."""
        skip = {"sink", "recent", "model_steps", "model_lr", "model_rotation_lr", "model_objective", "model_seq_len",
                "rope_fit_seq_len"}  # fmt: skip
        fields = asdict(self)
        if fields["method"] in QUANTMLA_METHODS:  # quantmla-raq's layer stage is QuantMLA's: one stage serves both
            fields["method"] = "quantmla"
        return (("version", LAYER_STAGE_VERSION), *((k, v) for k, v in fields.items() if k not in skip))


@dataclass
class LayerStage:
    """The layer-local stage's result: per cache index the chosen transforms and every candidate."""

    key: tuple
    data_sha256: str
    rows: list[dict]
    chosen: dict[int, tuple[ContentTransform, RopeTransform]]
    candidates: dict[int, tuple[dict, dict]]

    @property
    def layers(self) -> list[int]:
        """The cache indices this stage covers."""
        return [r["layer"] for r in self.rows]


def merge_layer_stages(parts: list[LayerStage]) -> LayerStage:
    """One layer stage from stages of disjoint layer subsets (``layer_stage(..., layers=...)`` run apart).

    Each layer's result depends only on the unfused model, the data, the config and its own random
    stream, so the merge equals the stage computed in one run.
    """
    if not parts:
        raise ValueError("no layer stages to merge")
    first = parts[0]
    for p in parts[1:]:
        if p.key != first.key or p.data_sha256 != first.data_sha256:
            raise ValueError("layer stages come from different configs or calibration data; they cannot be merged")
    seen: dict[int, int] = {}
    for i, p in enumerate(parts):
        for idx in p.layers:
            if idx in seen:
                raise ValueError(f"layer {idx} is in stage {seen[idx]} and stage {i}; the parts must be disjoint")
            seen[idx] = i
    rows = sorted((r for p in parts for r in p.rows), key=lambda r: r["layer"])
    chosen = dict(sorted((k, v) for p in parts for k, v in p.chosen.items()))
    candidates = dict(sorted((k, v) for p in parts for k, v in p.candidates.items()))
    return LayerStage(first.key, first.data_sha256, rows, chosen, candidates)


@dataclass
class CalibrationReport:
    config: CalibrationConfig
    data_sha256: str
    layers: list[dict] = field(default_factory=list)  # per layer: content / rope val errors before, after
    model_level: dict | None = None  # quantmla's model-level stage: held-out KL per start, after, history
    #: a codec method's result (raq, blockgtq): per-layer formats and fitted write-side parameters
    codec: ModelCodec | None = field(default=None, repr=False)
    layer_stage: LayerStage | None = field(default=None, repr=False)  # reusable by calibrate(layer_stage=)
    #: raq-alloc's allocation of formats to layers: the budget, the held-out KL of every option, the schemes
    allocation: dict | None = None
    #: whether transforms were fused into the weights (``rtn``, and a codec method that fused none: ``False``)
    weights_changed: bool = False
    #: the transforms fused, by cache index: ``(content or None, RoPE or None)`` (an FP8 export fuses them again in
    #: float32: :func:`~quantmla.calibrate.checkpoint.fp8_fused_in_float32`)
    fused: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        d = {"config": asdict(self.config), "data_sha256": self.data_sha256, "layers": self.layers}
        d["model_level"] = self.model_level
        d["allocation"] = self.allocation
        return d


def calibrate_model(
    model: nn.Module,
    tokenizer,
    texts,
    progress: bool = True,
    layer_stage: LayerStage | None = None,
    alloc_fits: dict | None = None,
    **kwargs,
):
    """Calibrate ``model`` in place for a quantised cache and return ``(model, report)``.

    ``texts``: a string, a list of strings (joined), or token windows ``[N, T]``; keyword arguments
    are :class:`CalibrationConfig` fields (``scheme``, ``method``, ``steps``, ``num_seqs``, ...).
    The model keeps its full-precision function exactly; only the basis of each cached path changes.
    ``method="rtn"`` leaves the weights untouched (the report still holds its held-out layer errors).
    Every other method picks, per layer and path on held-out data, between its transform and the
    original-basis identity (the untouched model's cache), so none is worse than RTN on its layer
    objective. ``method="quantmla"`` runs the layer stage (per layer and path, the paper's
    objectives) and then the model stage (:mod:`quantmla.calibrate.model_level`, ``model_steps`` > 0):
    all layers jointly against the KL from the full-precision model, with the cache as decode sees it
    (``sink``, ``recent``). ``layer_stage``: ``report.layer_stage`` of an earlier run on the same
    (unfused) model, data and config up to ``sink``, ``recent`` and the model-level fields; it skips
    the layer-local stage. ``alloc_fits``: ``raq-alloc``'s per-layer fits
    (:func:`~quantmla.calibrate.related.raq_alloc_fits`) on the same model, data and config, computed beforehand
    (layer by layer); only the allocation runs here.
    """
    cfg = CalibrationConfig(**kwargs)
    if alloc_fits is not None and cfg.method != "raq-alloc":
        raise ValueError(f"alloc_fits are raq-alloc's per-layer fits; method {cfg.method} takes none")
    train_w, val_w, data_sha = calibration_windows(tokenizer, texts, cfg)
    report = CalibrationReport(cfg, data_sha)
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    if cfg.method in CODEC_METHODS:
        if layer_stage is not None:
            raise ValueError(f"method {cfg.method} has no layer stage to reuse; run without layer_stage")
        long = _rope_fit_windows(cfg, train_w, val_w)
        report.codec, report.layers, fused, report.allocation = fit_codec(
            model, adapter, modules, train_w, val_w, cfg, progress, long, alloc_fits=alloc_fits
        )
        for idx, attn in modules:
            if idx in fused:
                fuse_content(adapter, attn, fused[idx])
        report.weights_changed = bool(fused)
        report.fused = {idx: (t, None) for idx, t in fused.items()}
        what = "content rotations fused into the weights" if fused else "the weights are left untouched"
        logger.info("method %s: %s; the cache codec is %r", cfg.method, what, report.codec.name)
        return model, report
    if layer_stage is None:
        layer_stage = _layer_stage(model, adapter, modules, train_w, val_w, cfg, report.data_sha256, progress)
    elif layer_stage.key != cfg.layer_key() or layer_stage.data_sha256 != report.data_sha256:
        raise ValueError("layer_stage comes from a different config or calibration data; run without it")
    elif missing := [idx for idx, _ in modules if idx not in layer_stage.chosen]:
        raise ValueError(f"layer_stage lacks layers {missing}; merge the parts with merge_layer_stages first")
    report.layer_stage = layer_stage
    report.layers = [dict(r) for r in layer_stage.rows]
    if cfg.method == "rtn":
        logger.info("method rtn: the model's weights are left untouched (the cache quantises c as the model has it)")
        return model, report
    chosen = dict(layer_stage.chosen)
    if cfg.method in QUANTMLA_METHODS and cfg.model_steps > 0:
        long_train, long_val = (_joined(w, cfg.model_seq_len) for w in (train_w, val_w))
        chosen, report.model_level = _model_stage(
            model, adapter, modules, long_train, long_val, cfg, layer_stage, progress
        )
    if cfg.method == "quantmla-raq":  # RAQ-MLA on the unfused model first: one of the combined method's two bases
        raq_cfg = replace(cfg, method="raq")
        long = _rope_fit_windows(cfg, train_w, val_w)
        unfused = fit_codec(model, adapter, modules, train_w, val_w, raq_cfg, progress, long)[:2]
        undo = undo_maps(model, adapter, modules, chosen, cfg.paths)
    for idx, attn in modules:
        if "content" in cfg.paths:
            fuse_content(adapter, attn, chosen[idx][0])
        if "rope" in cfg.paths:
            fuse_rope(adapter, attn, chosen[idx][1], model.config)
    report.weights_changed = bool(cfg.paths)
    report.fused = {idx: tuple(t if p in cfg.paths else None for p, t in zip(PATHS, chosen[idx], strict=True))
                    for idx, _ in modules}  # fmt: skip
    if report.model_level is not None:
        _final_layer_errors(model, adapter, modules, val_w, cfg, report.layers)
    if cfg.method == "quantmla-raq":  # and on the fused model; per layer and path the better held-out fit
        fused = fit_codec(model, adapter, modules, train_w, val_w, raq_cfg, progress, long)[:2]
        name = f"quantmla-raq {parse_scheme(cfg.scheme).name}"
        report.codec, raq_rows = pick(name, fused, unfused, undo)
        for row, raq_row in zip(report.layers, raq_rows, strict=True):
            row["raq"] = raq_row
        kept = [f"{p} {sum(r[p]['basis'] == 'unfused' for r in raq_rows)}/{len(raq_rows)}" for p in PATHS]
        logger.info("method quantmla-raq: RAQ-MLA's fit from the unfused basis kept in layers: %s", ", ".join(kept))
    return model, report


def _rope_fit_windows(cfg: CalibrationConfig, train_w, val_w):
    """RAQ-MLA's post-RoPE fitting windows ``(train, held-out)``, or ``None`` for the calibration windows."""
    n = cfg.rope_fit_seq_len or cfg.model_seq_len
    return None if n is None else tuple(_joined(w, n) for w in (train_w, val_w))


def layer_stage(model: nn.Module, tokenizer, texts, layers=None, progress: bool = True, **kwargs) -> LayerStage:
    """QuantMLA's layer-local stage alone, for ``layers`` (cache indices; ``None``: all).

    The layers are independent (each sees the unfused model's inputs and has its own random stream),
    so a large model's stage can be split across processes or GPUs and joined with
    :func:`merge_layer_stages`; ``calibrate_model(..., layer_stage=merged)`` then runs the rest. The
    model is not changed (latent attention is enabled on it if it was not).
    """
    cfg = CalibrationConfig(**kwargs)
    train_w, val_w, data_sha = calibration_windows(tokenizer, texts, cfg)
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    if layers is not None:
        valid = [idx for idx, _ in modules]
        bad = [i for i in layers if i not in valid]
        if bad:
            raise ValueError(f"layers {bad} are not cache indices of this model; valid: {valid}")
        modules = [(idx, attn) for idx, attn in modules if idx in set(layers)]
    return _layer_stage(model, adapter, modules, train_w, val_w, cfg, data_sha, progress)


def calibration_windows(tokenizer, texts, cfg: CalibrationConfig) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Training and held-out token windows, and the sha256 of both."""
    from quantmla.measure.tokens import token_windows

    need = cfg.num_seqs + cfg.val_seqs
    if isinstance(texts, torch.Tensor):  # token windows [N, T] given directly
        if texts.dim() != 2 or texts.shape[0] < need:
            raise ValueError(f"token windows must be [>= {need}, seq_len], got {tuple(texts.shape)}")
        windows = texts[:need].long()
    else:
        text = texts if isinstance(texts, str) else "\n\n".join(texts)
        windows = token_windows(tokenizer, text, cfg.seq_len, need)
    return windows[: cfg.num_seqs], windows[cfg.num_seqs :], hashlib.sha256(windows.numpy().tobytes()).hexdigest()


def layer_stage_windows(cfg: CalibrationConfig, train_w: torch.Tensor, val_w: torch.Tensor) -> list[torch.Tensor]:
    """The token windows a per-layer method reads: the calibration and held-out windows, then (``raq``) the
    longer ones of its post-RoPE fit."""
    long = _rope_fit_windows(cfg, train_w, val_w) if cfg.method == "raq" else None
    return [train_w, val_w, *(long or ())]


def layer_stage_on(model, adapter, modules, train_w, val_w, cfg: CalibrationConfig, data_sha: str, inputs
                   ) -> LayerStage:  # fmt: skip
    """The layer stage of ``modules`` (no progress bar), their attention inputs from ``inputs`` (a
    :class:`~quantmla.measure.layer_inputs.StreamedInputs` at their layer)."""
    return _layer_stage(model, adapter, modules, train_w, val_w, cfg, data_sha, False, inputs)


def _joined(windows: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """Consecutive windows joined into sequences of ``seq_len`` tokens (``None``: as they are)."""
    return windows if seq_len is None else windows.reshape(-1, seq_len)


def _final_layer_errors(model, adapter, modules, val_w, cfg, rows) -> None:
    """Each layer's held-out objectives in the fused model, whose cache is quantised as it is (RTN there)."""
    scheme = parse_scheme(cfg.scheme)
    for row, (idx, attn) in zip(rows, modules, strict=True):
        val = collect(model, idx, val_w, cfg.batch_size)
        g = latent_gain(adapter, attn)  # the fused model's gain: its original basis is the cache c' itself
        ident = original_basis(g)
        eye_r = torch.eye(attn.qk_rope_head_dim, dtype=torch.float64)
        c_err = mean_layer_loss(
            lambda b: content_loss(b, g, ident.rotation, ident.scales, scheme.content, cfg.group_size),  # noqa: B023
            val,
        )
        r_err = mean_layer_loss(lambda b: rope_loss(b, eye_r, eye_r, scheme.rope, cfg.group_size), val)  # noqa: B023
        row["content"] = {**row["content"], "val_final": c_err}
        row["rope"] = {**row["rope"], "val_final": r_err}
        del val


def _layer_stage(model, adapter, modules, train_w, val_w, cfg, data_sha, progress, inputs=None) -> LayerStage:
    """The layer stage on ``modules``; their attention inputs from ``inputs`` (a
    :class:`~quantmla.measure.layer_inputs.StreamedInputs`) or, ``None``, from ``model`` run from the embedding."""
    source = model if inputs is None else inputs
    scheme = parse_scheme(cfg.scheme)
    learn_cfg = LearnConfig(cfg.steps, cfg.lr)
    rows, chosen, candidates = [], {}, {}
    for idx, attn in tqdm(modules, desc=f"calibrate {cfg.method} {cfg.scheme}", unit="layer", disable=not progress):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + idx)  # per layer: subsets give the same draws
        train = collect(source, idx, train_w, cfg.batch_size)
        val = collect(source, idx, val_w, cfg.batch_size)
        row: dict = {"layer": idx}
        method = "quantmla" if cfg.method == "quantmla-raq" else cfg.method
        c_method = method if "content" in cfg.paths else "rtn"
        ct, row["content"] = content_transform(
            c_method, train, val, latent_gain(adapter, attn), scheme.content, cfg.group_size, learn_cfg, gen
        )
        pairs = adapter.rope_layout(model.config).cache_pairs(attn.qk_rope_head_dim)
        r_method = method if "rope" in cfg.paths else "rtn"
        rt, row["rope"] = rope_transform(r_method, train, val, pairs, scheme.rope, cfg.group_size, learn_cfg, gen)
        candidates[idx] = (row["content"].pop("candidates", {}), row["rope"].pop("candidates", {}))
        chosen[idx] = (ct, rt)
        rows.append(row)
        del train, val
    return LayerStage(cfg.layer_key(), data_sha, rows, chosen, candidates)


# model-level starts besides QuantMLA's layer stage: every layer with one baseline's transforms, each
# layer choosing (as the baseline does) between the baseline's candidate and the original basis
_UNIFORM_STARTS = {
    "rtn": (ORIGINAL, ORIGINAL),  # the untouched model
    "smoothquant": ("smooth", "smooth"),
    "quarot": ("hadamard", "quarot"),
}


def _baseline_choice(name: str, path_row: dict) -> str:
    """The candidate the baseline with candidate ``name`` picks for one layer path (as methods.py does)."""
    vals = path_row["candidate_val"]
    return name if name in vals and vals[name] < vals[ORIGINAL] else ORIGINAL


def _model_stage(model, adapter, modules, train_w, val_w, cfg, stage: LayerStage, progress):
    starts = {"quantmla-layer": dict(stage.chosen)}
    rows = {row["layer"]: row for row in stage.rows}
    for name, (c_name, r_name) in _UNIFORM_STARTS.items():
        start = {}
        for idx, _ in modules:
            c_cands, r_cands = stage.candidates[idx]
            ct, rt = stage.chosen[idx]
            if "content" in cfg.paths:
                ct = c_cands.get(_baseline_choice(c_name, rows[idx]["content"]))
            if "rope" in cfg.paths:
                rt = r_cands.get(_baseline_choice(r_name, rows[idx]["rope"]))
            if ct is None or rt is None:
                break
            start[idx] = (ct, rt)
        else:
            starts[name] = start
    gains = {idx: latent_gain(adapter, attn) for idx, attn in modules}
    pairs = {idx: adapter.rope_layout(model.config).cache_pairs(attn.qk_rope_head_dim) for idx, attn in modules}
    mcfg = cfg.model_level()
    return refine(
        model, modules, starts, gains, pairs, train_w, val_w, parse_scheme(cfg.scheme), cfg.group_size,
        cfg.sink, cfg.recent, mcfg, trainable=cfg.paths, progress=progress,
    )  # fmt: skip


def export(model: nn.Module, tokenizer, out: str | Path, report: CalibrationReport) -> Path:
    """Write a transformers directory (fused weights, config, tokenizer) and ``quantmla.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    was_latent = is_latent_attention_enabled(model)
    if was_latent:
        disable_latent_attention(model)
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if was_latent:
            enable_latent_attention(model)
    tokenizer.save_pretrained(out)
    write_export_meta(out, report, next(model.parameters()).dtype)
    return out


def export_changed(model: nn.Module, source: str | Path, out: str | Path, report: CalibrationReport,
                   copy: bool = False, keep_bf16: bool = False) -> dict:  # fmt: skip
    """Write ``model``, calibrated from the checkpoint directory ``source``, as that checkpoint with only its changed
    tensors replaced (untouched shards hard-linked, or copied with ``copy``; an FP8 source's changed weights
    re-quantised from their float32 fusion, or kept in BF16 with ``keep_bf16``), and ``quantmla.json``:
    :mod:`quantmla.calibrate.checkpoint`. Returns what it wrote (changed tensors, rewritten and linked shards)."""
    from quantmla.calibrate.checkpoint import export_changed as write

    dtype = next(model.parameters()).dtype
    return write(model, source, out, lambda d: write_export_meta(d, report, dtype), copy, keep_bf16, report.fused)


def write_export_meta(out: Path, report: CalibrationReport, dtype: torch.dtype) -> None:
    """``quantmla.json`` (and a codec method's codec) of ``report`` in ``out``; ``dtype``: the model's."""
    import transformers

    from quantmla import __version__

    cfg = report.config
    meta = {
        "format": META_FORMAT,
        "scheme": cfg.scheme,
        "method": cfg.method,
        "group_size": cfg.group_size,
        "sink": cfg.sink,
        "recent": cfg.recent,
        "steps": cfg.steps,
        "paths": list(cfg.paths),
        "dtype": str(dtype).removeprefix("torch."),
        "calibration": {
            "num_seqs": cfg.num_seqs,
            "val_seqs": cfg.val_seqs,
            "seq_len": cfg.seq_len,
            "model_seq_len": cfg.model_seq_len or cfg.seq_len,
            "data_sha256": report.data_sha256,
            "seed": cfg.seed,
        },
        "versions": {
            "quantmla": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "layers": report.layers,
        "model_level": None
        if report.model_level is None
        else {**report.model_level, "steps": cfg.model_steps, "lr": cfg.model_lr},
    }
    if report.allocation is not None:
        meta["allocation"] = report.allocation
    if report.codec is not None:
        meta["layer_schemes"] = write_codec(out, report.codec)[1]
    write_meta(out, meta)
