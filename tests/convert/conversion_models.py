"""Tiny random GQA/MHA models of every family a conversion reads (float64, eval mode)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)  # fmt: skip


def tiny(family: str, heads: int = 4, kv: int = 2, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random model of ``family`` (llama, qwen2, qwen3, qwen3_moe) with ``heads`` query and ``kv`` KV heads of 16.
    Biases and norm gains are randomised too, so that a mapping that drops them shows."""
    torch.manual_seed(seed)
    kw = {**COMMON, "num_attention_heads": heads, "num_key_value_heads": kv, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kw))
    elif family == "qwen3_moe":
        kw.setdefault("num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 32)
        kw.setdefault("norm_topk_prob", False)
        model = Qwen3MoeForCausalLM._from_config(Qwen3MoeConfig(**kw), experts_implementation="eager")
    else:
        raise ValueError(family)
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def token_batches(n: int = 2, t: int = 40, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n * batch, t), generator=g)
