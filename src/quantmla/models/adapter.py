"""Model adapters: where each MLA family keeps the pieces QuantMLA works on, named by role.

An adapter is registered per architecture (``config.model_type``); algorithms ask it for roles
(latent rows of ``kv_a_proj_with_mqa``, per-head ``W_UK``/``W_UV``, the query RoPE rows, the RoPE
pair layout, ...) and never test the model class themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLADims:
    """Shapes of one MLA attention (METHOD.md section 1 naming)."""

    num_heads: int
    kv_lora_rank: int  # d_c
    rope_dim: int  # d_r
    nope_dim: int  # d_n
    v_dim: int
    q_lora_rank: int | None

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "rope_dim", "nope_dim", "v_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim={self.rope_dim} must be even (RoPE rotates pairs)")


@dataclass(frozen=True)
class RopeLayout:
    """Which channels RoPE rotates together, in the projection rows and in the cached key.

    ``interleaved``: pair i is channels (2i, 2i+1); otherwise (rotate-half) pair i is (i, i + d/2).
    """

    weight_interleaved: bool
    cache_interleaved: bool

    @staticmethod
    def pairs(dim: int, interleaved: bool) -> torch.Tensor:
        """``[dim/2, 2]`` channel indices of each frequency pair (pair i rotates at frequency i)."""
        i = torch.arange(dim // 2)
        if interleaved:
            return torch.stack([2 * i, 2 * i + 1], dim=-1)
        return torch.stack([i, i + dim // 2], dim=-1)

    def weight_pairs(self, dim: int) -> torch.Tensor:
        return self.pairs(dim, self.weight_interleaved)

    def cache_pairs(self, dim: int) -> torch.Tensor:
        return self.pairs(dim, self.cache_interleaved)


class MLAAdapter:
    """Base adapter for transformers' MLA attention modules (DeepSeek-V2 naming)."""

    #: ``config.model_type`` values this adapter serves
    model_types: tuple[str, ...] = ()
    #: class names of the attention modules in the model
    attention_classes: tuple[str, ...] = ()
    #: human-readable family description for error messages
    description: str = ""

    # -- model level ------------------------------------------------------------------------
    def dims(self, config) -> MLADims:
        return MLADims(
            num_heads=config.num_attention_heads,
            kv_lora_rank=config.kv_lora_rank,
            rope_dim=config.qk_rope_head_dim,
            nope_dim=config.qk_nope_head_dim,
            v_dim=config.v_head_dim,
            q_lora_rank=getattr(config, "q_lora_rank", None),
        )

    def num_cache_layers(self, config) -> int:
        return config.num_hidden_layers

    def rope_layout(self, config) -> RopeLayout:
        interleave = bool(getattr(config, "rope_interleave", True))
        # transformers' interleaved path de-interleaves while rotating: the cache is rotate-half.
        return RopeLayout(weight_interleaved=interleave, cache_interleaved=False)

    def attention_modules(self, model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
        """Yield ``(cache_index, attention_module)`` in cache-index order."""
        found = [(m.layer_idx, m) for m in model.modules() if type(m).__name__ in self.attention_classes]
        yield from sorted(found, key=lambda t: t[0])

    # -- per attention module ------------------------------------------------------------------
    def softmax_scale(self, attn: nn.Module) -> float:
        """``1/sqrt(d_n + d_r)`` times the YaRN mscale correction, as the module applies it."""
        return float(attn.scaling)

    def latent_scale(self, attn: nn.Module) -> float:
        """Factor the cached latent carries after the RMSNorm (1 except LongCat)."""
        return 1.0

    def query_scale(self, attn: nn.Module) -> float:
        """Factor the query carries after ``q_b_proj`` (1 except LongCat)."""
        return 1.0

    def kv_a_proj(self, attn: nn.Module) -> nn.Linear:
        return attn.kv_a_proj_with_mqa

    def latent_rows(self, attn: nn.Module) -> slice:
        """Rows of ``kv_a_proj_with_mqa`` that produce the content latent ``y_t``."""
        return slice(0, attn.kv_lora_rank)

    def rope_rows(self, attn: nn.Module) -> slice:
        """Rows of ``kv_a_proj_with_mqa`` that produce the RoPE key ``r_t``."""
        return slice(attn.kv_lora_rank, attn.kv_lora_rank + attn.qk_rope_head_dim)

    def kv_norm(self, attn: nn.Module) -> nn.Module:
        return attn.kv_a_layernorm

    def kv_b_proj(self, attn: nn.Module) -> nn.Linear:
        return attn.kv_b_proj

    def _kv_b_heads(self, attn: nn.Module) -> torch.Tensor:
        w = attn.kv_b_proj.weight
        return w.view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, attn.kv_lora_rank)

    def w_uk(self, attn: nn.Module) -> torch.Tensor:
        """Per-head key up-projection ``[H, d_n, d_c]`` (a view of ``kv_b_proj.weight``)."""
        return self._kv_b_heads(attn)[:, : attn.qk_nope_head_dim]

    def w_uv(self, attn: nn.Module) -> torch.Tensor:
        """Per-head value up-projection ``[H, d_v, d_c]`` (a view of ``kv_b_proj.weight``)."""
        return self._kv_b_heads(attn)[:, attn.qk_nope_head_dim :]

    def q_proj(self, attn: nn.Module) -> nn.Linear:
        """The projection whose rows hold the per-head queries (``q_b_proj`` or ``q_proj``)."""
        return attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj

    def q_rope_rows(self, attn: nn.Module) -> torch.Tensor:
        """``[H, d_r]`` row indices of :meth:`q_proj` holding each head's RoPE query."""
        hd = attn.qk_nope_head_dim + attn.qk_rope_head_dim
        base = torch.arange(attn.num_heads).unsqueeze(1) * hd + attn.qk_nope_head_dim
        return base + torch.arange(attn.qk_rope_head_dim).unsqueeze(0)


_REGISTRY: dict[str, MLAAdapter] = {}


def register_adapter(adapter: MLAAdapter) -> MLAAdapter:
    for mt in adapter.model_types:
        _REGISTRY[mt] = adapter
    return adapter


def supported_architectures() -> str:
    seen: dict[int, MLAAdapter] = {id(a): a for a in _REGISTRY.values()}
    return "; ".join(f"{'/'.join(a.model_types)} ({a.description})" for a in seen.values())


def get_adapter(model_or_config) -> MLAAdapter:
    """The adapter for a model or config, or a ``ValueError`` listing the supported architectures."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    adapter = _REGISTRY.get(model_type)
    if adapter is None:
        arch = (getattr(config, "architectures", None) or [type(model_or_config).__name__])[0]
        raise ValueError(
            f"{arch} (model_type {model_type!r}) is not a supported MLA architecture; "
            f"supported: {supported_architectures()}"
        )
    return adapter
