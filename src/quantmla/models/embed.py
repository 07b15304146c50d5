"""A model with a wider content latent that computes the same function: the latent embedded by an
orthogonal map.

``c' = s * c Q`` with ``Q [d_c, d_c']`` orthonormal rows (``Q Q^T = I``) and ``s = sqrt(d_c' / d_c)``,
so that ``mean(c'^2) = mean(c^2)`` and the RMSNorm (its epsilon included) sees the same statistic:

* ``kv_a_proj``'s latent rows: ``W' = s Q^T W`` (and the bias ``b' = s b Q``);
* ``kv_a_layernorm``: unit gain (the old gain ``g`` moves into ``kv_b_proj``);
* ``kv_b_proj``: ``W_b' = W_b diag(g) Q / s``, so ``norm(c') W_b'^T = norm(c) diag(g) W_b^T``.

Everything else is copied. This gives the bundled model (latent 128) DeepSeek's production geometry
(latent 512 + RoPE 64 = 576 values a token), which engines' MLA kernels require.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from quantmla.models.adapter import get_adapter

#: model types whose latent is plain RMSNorm output (no extra scale; LongCat scales it by its width)
EMBEDDABLE = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite")


def orthonormal_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """``[rows, cols]`` float64 with orthonormal rows, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).T.contiguous()


@torch.no_grad()
def embed_latent(model: PreTrainedModel, kv_lora_rank: int = 512, seed: int = 0) -> PreTrainedModel:
    """A new model equal in function to ``model`` whose content latent has ``kv_lora_rank`` channels."""
    cfg = model.config
    if cfg.model_type not in EMBEDDABLE:
        raise ValueError(f"model_type {cfg.model_type!r} cannot be embedded; valid: {', '.join(EMBEDDABLE)}")
    d_old = cfg.kv_lora_rank
    if kv_lora_rank < d_old:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} is below the model's {d_old}: an embedding only widens")
    adapter = get_adapter(model)
    new_cfg = copy.deepcopy(cfg)
    new_cfg.kv_lora_rank = kv_lora_rank
    dtype = next(model.parameters()).dtype
    new = AutoModelForCausalLM.from_config(new_cfg, dtype=dtype, attn_implementation=cfg._attn_implementation)
    state = dict(model.state_dict())
    q = orthonormal_rows(d_old, kv_lora_rank, seed)
    s = math.sqrt(kv_lora_rank / d_old)
    names = {id(m): n for n, m in model.named_modules()}
    for _, attn in adapter.attention_modules(model):
        prefix = names[id(attn)] + "."
        proj, norm, kvb = adapter.kv_a_proj(attn), adapter.kv_norm(attn), adapter.kv_b_proj(attn)
        lat, rope = adapter.latent_rows(attn), adapter.rope_rows(attn)
        w = proj.weight.double()
        key = prefix + _child_name(attn, proj)
        state[key + ".weight"] = torch.cat([s * q.T @ w[lat], w[rope]]).to(dtype)
        if proj.bias is not None:
            b = proj.bias.double()
            state[key + ".bias"] = torch.cat([s * b[lat] @ q, b[rope]]).to(dtype)
        g = norm.weight.double()
        state[prefix + _child_name(attn, norm) + ".weight"] = torch.ones(kv_lora_rank, dtype=dtype)
        state[prefix + _child_name(attn, kvb) + ".weight"] = (kvb.weight.double() * g[None, :] @ q / s).to(dtype)
    new.load_state_dict(state, strict=True)
    return new.to(next(model.parameters()).device).eval()


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    for name, m in parent.named_modules():
        if m is child:
            return name
    raise ValueError(f"{type(child).__name__} is not inside {type(parent).__name__}")
