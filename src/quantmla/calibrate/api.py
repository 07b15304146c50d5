"""``quantmla.calibrate``: calibrate, fuse and export, one layer at a time."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from quantmla.calibrate.methods import METHODS, LearnConfig, content_transform, rope_transform
from quantmla.calibrate.objectives import collect, latent_gain
from quantmla.models.adapter import get_adapter
from quantmla.models.latent import disable_latent_attention, enable_latent_attention, is_latent_attention_enabled
from quantmla.quant.scheme import parse_scheme
from quantmla.transforms.fuse import fuse_content, fuse_rope

META_FILE = "quantmla.json"
META_FORMAT = 1
PATHS = ("content", "rope")


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

    def __post_init__(self) -> None:
        s = parse_scheme(self.scheme)
        if not s.quantized:
            raise ValueError(f"scheme={self.scheme!r} does not quantise: nothing to calibrate")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; valid: {', '.join(METHODS)}")
        bad = [p for p in self.paths if p not in PATHS]
        if bad:
            raise ValueError(f"paths {bad}; valid: {PATHS}")
        for name in ("num_seqs", "val_seqs", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        LearnConfig(self.steps, self.lr)


@dataclass
class CalibrationReport:
    config: CalibrationConfig
    data_sha256: str
    layers: list[dict] = field(default_factory=list)  # per layer: content / rope val errors before, after

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "data_sha256": self.data_sha256, "layers": self.layers}


def calibrate(model: nn.Module, tokenizer, texts, progress: bool = True, **kwargs):
    """Calibrate ``model`` in place for a quantised cache and return ``(model, report)``.

    ``texts``: a string, a list of strings (joined), or token windows ``[N, T]``; keyword arguments
    are :class:`CalibrationConfig` fields (``scheme``, ``method``, ``steps``, ``num_seqs``, ...).
    The model keeps its full-precision function exactly; only the basis of each cached path changes.
    """
    from quantmla.eval.ppl import token_windows

    cfg = CalibrationConfig(**kwargs)
    if isinstance(texts, torch.Tensor):  # token windows [N, T] given directly
        need = cfg.num_seqs + cfg.val_seqs
        if texts.dim() != 2 or texts.shape[0] < need:
            raise ValueError(f"token windows must be [>= {need}, seq_len], got {tuple(texts.shape)}")
        windows = texts[:need].long()
    else:
        text = texts if isinstance(texts, str) else "\n\n".join(texts)
        windows = token_windows(tokenizer, text, cfg.seq_len, cfg.num_seqs + cfg.val_seqs)
    train_w, val_w = windows[: cfg.num_seqs], windows[cfg.num_seqs :]
    report = CalibrationReport(cfg, hashlib.sha256(windows.numpy().tobytes()).hexdigest())
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    adapter = get_adapter(model)
    scheme = parse_scheme(cfg.scheme)
    learn_cfg = LearnConfig(cfg.steps, cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    modules = list(adapter.attention_modules(model))
    for idx, attn in tqdm(modules, desc=f"calibrate {cfg.method} {cfg.scheme}", unit="layer", disable=not progress):
        train = collect(model, idx, train_w, cfg.batch_size)
        val = collect(model, idx, val_w, cfg.batch_size)
        row: dict = {"layer": idx}
        c_method = cfg.method if "content" in cfg.paths else "rtn"
        ct, row["content"] = content_transform(
            c_method, train, val, latent_gain(adapter, attn), scheme.content, cfg.group_size, learn_cfg, gen
        )
        pairs = adapter.rope_layout(model.config).cache_pairs(attn.qk_rope_head_dim)
        r_method = cfg.method if "rope" in cfg.paths else "rtn"
        rt, row["rope"] = rope_transform(r_method, train, val, pairs, scheme.rope, cfg.group_size, learn_cfg, gen)
        fuse_content(adapter, attn, ct)
        fuse_rope(adapter, attn, rt, model.config)
        report.layers.append(row)
        del train, val
    return model, report


def export(model: nn.Module, tokenizer, out: str | Path, report: CalibrationReport) -> Path:
    """Write a transformers directory (fused weights, config, tokenizer) and ``quantmla.json``."""
    import transformers

    import quantmla

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
        "calibration": {
            "num_seqs": cfg.num_seqs,
            "val_seqs": cfg.val_seqs,
            "seq_len": cfg.seq_len,
            "data_sha256": report.data_sha256,
            "seed": cfg.seed,
        },
        "versions": {
            "quantmla": quantmla.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "layers": report.layers,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_meta(path: str | Path) -> dict | None:
    """The validated ``quantmla.json`` of a model directory, ``None`` if it has none."""
    f = Path(path) / META_FILE
    if not f.exists():
        return None
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON ({e}); re-export the model with `quantmla calibrate`") from None
    need = {"format": int, "scheme": str, "method": str, "group_size": int, "sink": int, "recent": int}
    missing = [k for k in need if k not in meta]
    wrong = [k for k, t in need.items() if k in meta and not isinstance(meta[k], t)]
    if missing or wrong:
        raise ValueError(f"{f}: missing keys {missing}, wrongly typed keys {wrong}; expected {list(need)}")
    if meta["format"] != META_FORMAT:
        raise ValueError(f"{f}: format {meta['format']} is not supported (this quantmla reads {META_FORMAT})")
    parse_scheme(meta["scheme"])  # raises with the valid names
    if meta["method"] not in METHODS:
        raise ValueError(f"{f}: method {meta['method']!r} unknown; valid: {', '.join(METHODS)}")
    return meta
