"""Seconds per layer of QuantMLA's layer stage at DeepSeek-V2-Lite's attention shape (random weights).

Paper recipe by default: 300 steps per path (from the best-validating start of each path),
128 calibration + 32 held-out sequences; here of 2048 tokens. One decoder layer is built.

    PYTHONPATH=src:benchmarks python benchmarks/calibration_timing.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from shapes import v2_lite_attention_model

from quantmla.calibrate import calibrate_model


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
    model = v2_lite_attention_model(args.seq_len, args.device)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (args.num_seqs + args.val_seqs, args.seq_len))
    t0 = time.perf_counter()
    _, rep = calibrate_model(
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
        model_steps=0,  # the layer stage only: the model stage is whole-model (model_stage_timing.py)
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
