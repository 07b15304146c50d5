"""Seconds per layer of ``quantmla analyze`` at DeepSeek-V2-Lite's attention shape (random weights).

16 heads, latent 512, RoPE key 64, nope/value 128, hidden 2048, no q LoRA; 128 sequences of 2048
tokens by default. One decoder layer is built (its MLP is irrelevant here) and layer 0 is analysed.

    PYTHONPATH=src:benchmarks python benchmarks/analysis_timing.py --num-seqs 128 --seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from shapes import v2_lite_attention_model

from quantmla.analysis import AnalysisConfig, analyze


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    model = v2_lite_attention_model(args.seq_len, args.device)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (args.num_seqs, args.seq_len))
    acfg = AnalysisConfig(probes=args.probes, batch_size=args.batch_size)
    t0 = time.perf_counter()
    rep = analyze(model, ids, acfg, progress=False)
    wall = time.perf_counter() - t0
    lr = rep.layers[0]
    print(json.dumps({
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "num_seqs": args.num_seqs, "seq_len": args.seq_len, "probes": args.probes, "batch_size": args.batch_size,
        "seconds_per_layer": lr.seconds, "wall_seconds": wall,
        "content_gaussian": lr.results["content"]["gaussian"]["response"],
        "rope_gaussian": lr.results["rope"]["gaussian"]["response"],
        "linear_check": lr.linear_check,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
