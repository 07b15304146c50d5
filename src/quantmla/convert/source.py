"""The GQA/MHA models a conversion reads (Llama, Qwen2, Qwen3, Qwen3-MoE), checked from their config before any
weight is read, and one decoder layer's attention weights as float64 tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: model_type -> what the conversion reads there
SOURCE_FAMILIES = {
    "llama": "Llama (attention_bias=False)",
    "qwen2": "Qwen2 (query/key/value biases)",
    "qwen3": "Qwen3 (per-head q_norm/k_norm)",
    "qwen3_moe": "Qwen3-MoE (per-head q_norm/k_norm, routed experts with norm_topk_prob=False)",
}


@dataclass(frozen=True)
class SourceShape:
    """What a conversion needs of the source's config."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    rope_theta: float
    rms_norm_eps: float
    qk_norm: bool
    moe: bool

    @property
    def group(self) -> int:
        """Query heads a KV head serves."""
        return self.num_heads // self.num_kv_heads


def _rope(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if not params and getattr(config, "rope_theta", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_theta}
    return dict(params)


def source_shape(config) -> SourceShape:
    """The source's shape, or one ``ValueError`` naming the first setting a conversion does not handle exactly."""
    mt = getattr(config, "model_type", None)
    if mt not in SOURCE_FAMILIES:
        raise ValueError(
            f"model_type={mt!r} is not a GQA/MHA family the conversion reads; valid: {', '.join(SOURCE_FAMILIES)}"
        )
    rope = _rope(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r}: DeepSeek's one RoPE key keeps the default schedule only; valid: default"
        )
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={config.partial_rotary_factor}: valid: 1.0 (RoPE over the head)")
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(config, "layer_types", None) or [])
    ):
        raise ValueError("sliding-window attention layers: an MLA layer attends to the whole context; valid: none")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True: DeepSeek's MLPs have no biases; valid: False")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: DeepSeek's MLPs use silu; valid: silu")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is odd: RoPE needs pairs")
    if mt == "llama" and getattr(config, "attention_bias", False):
        raise ValueError("Llama with attention_bias=True (an output bias): valid: attention_bias=False")
    moe = mt == "qwen3_moe"
    if moe:
        if config.norm_topk_prob:
            raise ValueError(
                "norm_topk_prob=True: Qwen3-MoE's softmax renormalised over the top-k experts has no exact DeepSeek "
                "router (V2: softmax, not renormalised; V3: sigmoid); valid: norm_topk_prob=False"
            )
        if config.mlp_only_layers or config.decoder_sparse_step != 1:
            raise ValueError(
                f"mlp_only_layers={config.mlp_only_layers}, decoder_sparse_step={config.decoder_sparse_step}: "
                "DeepSeek places dense MLPs in the first layers only; valid: [] and 1"
            )
    return SourceShape(
        model_type=mt,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        num_layers=config.num_hidden_layers,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(config.rms_norm_eps),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        moe=moe,
    )


@dataclass
class SourceAttention:
    """One layer's attention, float64, rows per head as the source stores them (RoPE pairs ``(k, k + d/2)``)."""

    wq: torch.Tensor  # (heads * d, hidden)
    wk: torch.Tensor  # (kv * d, hidden)
    wv: torch.Tensor  # (kv * d, hidden)
    wo: torch.Tensor  # (hidden, heads * d)
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_gain: torch.Tensor | None  # (d,) Qwen3's q_norm weight
    k_gain: torch.Tensor | None  # (d,)
    eps: float

    @property
    def has_kv_bias(self) -> bool:
        return self.bk is not None or self.bv is not None


def _t(p: nn.Parameter | None) -> torch.Tensor | None:
    return None if p is None else p.detach().to(torch.float64).cpu().clone()


def _bias(p: nn.Parameter | None) -> torch.Tensor | None:
    """A bias as float64, or None where there is none or it is all zeros (nothing to carry)."""
    t = _t(p)
    return None if t is None or not t.any() else t


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def read_attention(attn: nn.Module, shape: SourceShape) -> SourceAttention:
    """The attention weights of one decoder layer's ``self_attn``."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return SourceAttention(
        wq=_t(attn.q_proj.weight),
        wk=_t(attn.k_proj.weight),
        wv=_t(attn.v_proj.weight),
        wo=_t(attn.o_proj.weight),
        bq=_bias(attn.q_proj.bias),
        bk=_bias(attn.k_proj.bias),
        bv=_bias(attn.v_proj.bias),
        q_gain=_t(q_norm.weight) if q_norm is not None else None,
        k_gain=_t(k_norm.weight) if k_norm is not None else None,
        eps=float(getattr(q_norm, "variance_epsilon", shape.rms_norm_eps)),
    )
