"""Model shapes the GPU timing scripts share."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config

from quantmla import enable_latent_attention


def v2_lite_attention_model(seq_len: int, device: str):
    """One randomly initialised decoder layer with DeepSeek-V2-Lite's attention (16 heads, latent 512,
    RoPE 64, nope/value 128, hidden 2048, no q LoRA), latent attention enabled, in eval mode."""
    cfg = DeepseekV2Config(
        vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=max(4096, seq_len),
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device).eval()
    return enable_latent_attention(model)


def v2_lite_model(device: str, dtype=torch.bfloat16, layers: int = 27, experts: int = 64, vocab: int = 102400,
                  hidden: int = 2048):  # fmt: skip
    """A randomly initialised model of DeepSeek-V2-Lite's full shape (27 layers, 64 routed + 2 shared
    experts, top-6, vocab 102400), built on ``device``, latent attention enabled, in eval mode."""
    cfg = DeepseekV2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts, n_shared_experts=2,
        num_experts_per_tok=6, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return enable_latent_attention(model.eval())
