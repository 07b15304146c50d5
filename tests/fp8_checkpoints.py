"""A DeepSeek-V3-config FP8 block-quantised checkpoint written by the tests: V3's per-head widths (latent 512, RoPE
64, nope 128, v 128), a real MoE block, 128 x 128 block scales (partial blocks included: ``kv_a_proj_with_mqa`` has
576 rows, as in V3), three shards and their index, as DeepSeek ships them (per-expert weights, router and norms and
embeddings unquantised): the embeddings, output layer and final norm in a shard of their own, the layers in two."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from quantmla.models.fp8_checkpoint import Fp8Blocks, quantize_blocks

QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def v3_fp8_config(layers: int = 3, vocab: int = 512, experts: int = 4, moe_width: int = 128,
                  **sizes) -> DeepseekV3Config:  # fmt: skip
    """``sizes``: other fields (e.g. ``hidden_size``, ``num_attention_heads``) over the defaults."""
    fields = dict(
        vocab_size=vocab, hidden_size=256, intermediate_size=384, moe_intermediate_size=moe_width,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=192, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=experts,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    return DeepseekV3Config(**(fields | sizes))


def quantised(name: str, t: torch.Tensor) -> bool:
    """The weights DeepSeek's FP8 checkpoints store in FP8: every linear layer's but the router's."""
    return t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name and (
        "lm_head" not in name) and not name.endswith("mlp.gate.weight")  # fmt: skip


def v3_model(layers: int = 3, seed: int = 0, vocab: int = 512, **config) -> DeepseekV3ForCausalLM:
    """The random float32 V3-config model the checkpoints hold (``config``: :func:`v3_fp8_config`'s sizes)."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(v3_fp8_config(layers, vocab, **config)).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, m.in_features**-0.5)
    return model


def write_v3_fp8_checkpoint(out: Path, layers: int = 3, seed: int = 0, fp8: bool = True, vocab: int = 512,
                            **config) -> Path:  # fmt: skip
    """:func:`v3_model` saved as an FP8 block-quantised checkpoint in ``out`` (``fp8=False``: BF16), three
    shards."""
    model = v3_model(layers, seed, vocab, **config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # the checkpoint's own names (per-expert weights)
    from safetensors.torch import load_file

    state = {}
    for f in sorted(out.glob("*.safetensors")):
        state |= load_file(str(f))
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    blocks = Fp8Blocks((128, 128))
    tensors = {}
    for name, t in state.items():
        if fp8 and quantised(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t, blocks)
        else:
            tensors[name] = t.to(torch.bfloat16)
    outer = sorted(n for n in tensors if ".layers." not in n)
    inner = sorted(n for n in tensors if ".layers." in n)
    half = len(inner) // 2
    weight_map = {}
    for i, part in enumerate((outer, inner[:half], inner[half:])):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / shard), metadata={"format": "pt"})
        weight_map |= {n: shard for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = json.loads((out / "config.json").read_text())
    if fp8:
        raw["quantization_config"] = QUANTIZATION
    raw["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out
