"""Seconds per layer of QuantMLA calibration at DeepSeek-V2-Lite's attention shape (random weights).

Paper recipe by default: 300 steps per path (the content path twice: identity and Hadamard starts),
128 calibration + 32 held-out sequences; here of 2048 tokens. One decoder layer is built.

    PYTHONPATH=src python benchmarks/calibration_timing.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config

from quantmla import enable_latent_attention
from quantmla.calibrate import calibrate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--val-seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--scheme", default="c4r4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    cfg = DeepseekV2Config(
        vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=max(4096, args.seq_len),
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(args.device).eval()
    enable_latent_attention(model)
    ids = torch.randint(0, cfg.vocab_size, (args.num_seqs + args.val_seqs, args.seq_len))
    t0 = time.perf_counter()
    _, rep = calibrate(
        model,
        None,
        ids,
        progress=False,
        scheme=args.scheme,
        method="quantmla",
        steps=args.steps,
        num_seqs=args.num_seqs,
        val_seqs=args.val_seqs,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    sec = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "args": vars(args),
                "seconds_per_layer": sec,
                "seconds_27_layers": 27 * sec,
                "layer": rep.layers[0],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
