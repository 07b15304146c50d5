"""Seconds per step of QuantMLA's model stage at DeepSeek-V2-Lite's full shape (random weights, BF16).

The model stage runs the whole model forward and backward (transform gradients only) per step, plus a
no-grad reference forward for the KL; this times a few steps and one held-out batch and extrapolates to
the recipe (150 steps of 4 x 512 tokens; 4 starts and 15 evaluations over 32 held-out sequences).

    PYTHONPATH=src:benchmarks python benchmarks/model_stage_timing.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from shapes import v2_lite_model

from quantmla.calibrate.model_level import InstalledPaths, LayerPaths, model_loss
from quantmla.calibrate.objectives import latent_gain
from quantmla.formats.scheme import parse_scheme
from quantmla.models import get_adapter
from quantmla.transforms import ContentTransform, RopeTransform


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    model = v2_lite_model(args.device, torch.bfloat16, args.layers, args.experts, args.vocab, args.hidden)
    sync()
    build = time.perf_counter() - t0
    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    layers = {}
    for idx, attn in modules:
        d, n = adapter.dims(model.config).kv_lora_rank, attn.qk_rope_head_dim // 2
        ident = (ContentTransform(torch.eye(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64)),
                 RopeTransform(torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)))  # fmt: skip
        pairs = adapter.rope_layout(model.config).cache_pairs(attn.qk_rope_head_dim)
        layers[idx] = LayerPaths(*ident, latent_gain(adapter, attn), pairs).to(args.device)
    install = InstalledPaths(modules, layers, parse_scheme("c4r4"), 64, 4, 128)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for lp in layers.values() for p in lp.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), device=args.device)
    times = []
    for _ in range(args.steps + 1):  # the first step warms up
        sync()
        t = time.perf_counter()
        loss = model_loss(model, x, install, "kl")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        model_loss(model, x, install, "kl")
    sync()
    val_batch = time.perf_counter() - t
    step = sorted(times[1:])[len(times[1:]) // 2]
    val_batches = 32 // args.batch_size
    total = 150 * step + (4 + 15) * val_batches * val_batch
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    print(json.dumps({
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "args": vars(args),
        "build_s": build, "step_s_median": step, "step_s_all": times, "val_batch_s": val_batch,
        "recipe_estimate_s": total, "peak_gib": peak,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
