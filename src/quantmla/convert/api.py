"""``quantmla.convert``: a GQA/MHA model (Llama, Qwen2, Qwen3, Qwen3-MoE) into MLA (MLAfication), written as a
DeepSeek model directory that the other quantmla commands, transformers and vLLM read."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantmla.convert.config import ConvertConfig
from quantmla.convert.deepseek import (
    build_deepseek,
    check_exportable,
    fold_linear_norms,
    latent_rms,
    unfold_linear_norms,
)
from quantmla.convert.distillation import DistillConfig, distill, kl_per_token
from quantmla.convert.source import SourceShape, decoder_layers, read_attention, source_shape
from quantmla.convert.stats import LayerStats, gather_stats
from quantmla.convert.surgery import LatentLayer, convert_layer

logger = logging.getLogger(__name__)
#: the record of a conversion, beside config.json in the output directory
RECORD_FILE = "mlafication.json"


@dataclass
class Conversion:
    shape: SourceShape
    config: ConvertConfig
    layers: list[LatentLayer]
    stats: list[LayerStats]

    def summary(self) -> dict:
        """What the conversion chose, per layer (JSON-ready)."""
        return {
            "config": asdict(self.config),
            "source": asdict(self.shape),
            "layers": [
                {
                    "rope_pairs": layer.pairs.tolist(),
                    "knorm_scale": None if layer.knorm_scale is None else layer.knorm_scale.tolist(),
                    "latent_rms": latent_rms(layer, st),
                }
                for layer, st in zip(self.layers, self.stats, strict=True)
            ],
        }

    def latent_norm_gains(self) -> list[float] | None:
        """The latent norm the export applies, for :func:`~quantmla.convert.partial.install_latent`: None (linear) or
        each layer's RMSNorm gain (``latent_norm='rms'``)."""
        if self.config.latent_norm == "linear":
            return None
        return [latent_rms(layer, st) for layer, st in zip(self.layers, self.stats, strict=True)]

    def cache_elements(self) -> tuple[int, int]:
        """``(converted, source)`` cached elements per token and layer: latent + shared RoPE key against
        2 x KV heads x head_dim."""
        first = self.layers[0]
        return first.latent_rank + 2 * first.rope_pairs, 2 * self.shape.num_kv_heads * self.shape.head_dim


def check_conversion(config, cfg: ConvertConfig, export: bool = True) -> SourceShape:
    """Every check of a conversion that needs no weight: the source family and settings, the pair count and rank,
    and (``export``) that DeepSeek's format can hold the choice. Returns the source's shape."""
    shape = source_shape(config)
    biased = getattr(config, "attention_bias", False) or shape.model_type == "qwen2"
    cfg.check_dims(shape.head_dim, shape.num_kv_heads, shape.hidden_size + int(biased))
    if export:
        if cfg.rope != "uniform":
            raise ValueError(
                f"rope={cfg.rope!r} keeps different pairs per KV head, which DeepSeek's one RoPE key cannot hold; "
                "valid for an export: uniform"
            )
        if cfg.rope_pairs >= shape.head_dim // 2:
            raise ValueError(
                f"rope_pairs={cfg.rope_pairs} keeps every pair of a {shape.head_dim}-dim head: an export needs at "
                f"least one NoPE pair; valid: 1 .. {shape.head_dim // 2 - 1}"
            )
    return shape


def convert(model: nn.Module, cfg: ConvertConfig, calibration: torch.Tensor, progress: bool = True,
            export: bool = True) -> Conversion:  # fmt: skip
    """Convert every attention layer of ``model`` (float64 algebra; the model itself unchanged) from statistics over
    ``calibration`` (token ids ``(N, T)``, in batches of ``cfg.batch_size``)."""
    shape = check_conversion(model.config, cfg, export)
    batches = list(calibration.split(cfg.batch_size))
    logger.info("convert: %s, %d layers, %d x %d calibration tokens; rope=%s r=%d, latent=%s rank %d, svd=%s, "
                "knorm=%s", shape.model_type, shape.num_layers, *calibration.shape, cfg.rope, cfg.rope_pairs,
                cfg.latent, cfg.latent_rank, cfg.svd, cfg.knorm)  # fmt: skip
    stats = gather_stats(model, shape, batches, progress)
    layers = [
        convert_layer(cfg, shape, read_attention(dec.self_attn, shape), st)
        for dec, st in zip(decoder_layers(model), stats, strict=True)
    ]
    if export:
        check_exportable(layers, shape)
    return Conversion(shape, cfg, layers, stats)


def to_deepseek(model: nn.Module, conv: Conversion, dtype: torch.dtype | None = None) -> nn.Module:
    """The DeepSeek model of a conversion (see :mod:`quantmla.convert.deepseek` for what it approximates)."""
    return build_deepseek(model, conv.shape, conv.layers, conv.stats, dtype, conv.config.latent_norm)


def distill_conversion(student: nn.Module, teacher: nn.Module, conv: Conversion, batches, cfg: DistillConfig,
                       progress: bool = True) -> list[dict]:  # fmt: skip
    """:func:`~quantmla.convert.distillation.distill` of a DeepSeek export: its norms made linear train as
    :class:`~quantmla.convert.deepseek.LinearNorm` (their rows unscaled) and are folded back afterwards."""
    eps = conv.shape.rms_norm_eps
    unfold_linear_norms(student, conv.layers, conv.config.latent_norm, eps)
    try:
        return distill(student, teacher, batches, cfg, progress)
    finally:
        fold_linear_norms(student, conv.layers, conv.stats, conv.config.latent_norm, eps)


@torch.no_grad()
def function_kl(teacher: nn.Module, student: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Mean KL(teacher || student) of the next-token distributions over ``windows`` (nats a token)."""
    device = next(student.parameters()).device
    total, n = 0.0, 0
    for ids in windows.split(batch_size):
        ids = ids.to(device)
        total += kl_per_token(teacher(ids, use_cache=False).logits, student(ids, use_cache=False).logits).item() * len(
            ids
        )
        n += len(ids)
    return total / max(n, 1)


@dataclass
class Written:
    path: Path
    record: dict = field(default_factory=dict)


def save(student: nn.Module, conv: Conversion, out: Path, tokenizer=None, extra: dict | None = None) -> Written:
    """Write the converted model (``save_pretrained``), its tokenizer and ``mlafication.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    converted, source = conv.cache_elements()
    record = {
        **conv.summary(),
        "cache_elements": {"converted": converted, "source": source, "share": converted / source},
        **(extra or {}),
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1))
    return Written(out, record)
