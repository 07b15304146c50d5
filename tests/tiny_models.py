"""Tiny random configurations of every supported MLA family, built from transformers' own configs.

They keep the production cache geometry that matters for quantisation (RoPE dim 64, latent a
multiple of 64) and shrink everything else, so the whole pipeline runs in seconds on a CPU.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeLiteConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LongcatFlashConfig,
    PreTrainedModel,
)

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_MOE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _v2(**kw):
    return DeepseekV2Config(**_COMMON, **_MOE, num_hidden_layers=2, first_k_dense_replace=1, **kw)


def _v3(**kw):
    return DeepseekV3Config(**_COMMON, **_MOE, num_hidden_layers=2, first_k_dense_replace=1, **kw)


def _glm(**kw):
    return Glm4MoeLiteConfig(**_COMMON, **_MOE, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], **kw)


def _longcat(**kw):
    return LongcatFlashConfig(
        **_COMMON,
        num_layers=2,
        ffn_hidden_size=96,
        expert_ffn_hidden_size=32,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        **kw,
    )


#: name -> factory of a tiny config; the set covers all four families, a YaRN config,
#: a ``q_lora_rank=None`` config and both RoPE weight layouts.
TINY_CONFIGS = {
    "deepseek_v2": lambda: _v2(q_lora_rank=32),
    "deepseek_v2_noqlora_yarn": lambda: _v2(q_lora_rank=None, rope_parameters=dict(_YARN)),
    "deepseek_v3": lambda: _v3(q_lora_rank=32),
    "deepseek_v3_yarn": lambda: _v3(q_lora_rank=32, rope_parameters=dict(_YARN)),
    "deepseek_v3_halfrope_noqlora": lambda: _v3(q_lora_rank=None, rope_interleave=False),
    "glm4_moe_lite": lambda: _glm(q_lora_rank=32),
    "longcat_flash": lambda: _longcat(q_lora_rank=32),
}


def tiny_config(name: str):
    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny config {name!r}; valid: {sorted(TINY_CONFIGS)}")
    return TINY_CONFIGS[name]()


def tiny_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = "eager",
) -> PreTrainedModel:
    """A randomly initialised tiny model of family ``name`` in eval mode (``experts_implementation=None``:
    transformers' default for the family)."""
    config = tiny_config(name)
    torch.manual_seed(seed)
    experts = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **experts)
    with torch.no_grad():  # random weights large enough that attention is far from uniform
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
    return model.to(dtype).eval()


def tiny_llama() -> LlamaForCausalLM:
    """A tiny non-MLA model (Llama), for the unsupported-architecture errors."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(cfg)
