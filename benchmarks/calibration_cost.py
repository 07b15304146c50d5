"""Calibration cost per layer of every method: wall time of one layer's calibration (its data collection included)
with the default recipe (128 x 512 calibration tokens, 32 x 512 held out, 300 steps where a method learns).

    python benchmarks/calibration_cost.py --device cpu                      # the bundled model v2, layer 0
    python benchmarks/calibration_cost.py --device cuda --shape v2-lite     # DeepSeek-V2-Lite's attention shape

``--shape v2-lite``: one random MLA layer at DeepSeek-V2-Lite's attention dims (hidden 2048, 16 heads, latent
512, RoPE 64, nope 128, v 128; a small dense MLP and vocabulary), random token ids: the cost depends on the
shapes, not on the weights. QuantMLA's row is its layer stage (its model-level stage runs once for all layers).
raq-alloc's and quantmla-raq's rows are the whole model's calibration divided by its layers (the allocation
needs every layer's options; quantmla-raq's model stage runs once for all layers; it runs on a copy).
quantmla-raq: QuantMLA's layer stage and model stage (150 steps), then RAQ-MLA's fits from both bases.
raq-alloc: RAQ-MLA's fits at each format of a layer's menu plus the allocation's held-out KL of each option, one
forward pass of the whole model per option over the held-out windows. Both model-level parts grow with the
depth, so at ``--shape v2-lite`` (one layer) their figures are lower bounds for the 27-layer model.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config

import quantmla
from quantmla.calibrate import layer_stage
from quantmla.calibrate.api import CalibrationConfig, calibrate_model, calibration_windows
from quantmla.calibrate.related import CODEC_METHODS, fit_codec
from quantmla.models.adapter import get_adapter
from quantmla.models.loading import builtin_text

METHODS = {  # method: the scheme it is timed at
    "rtn": "c2r4",
    "smoothquant": "c2r4",
    "quarot": "c2r4",
    "quantmla": "c2r4",
    "raq": "c2g128q94r4p128",
    "rolaq": "c2r4",
    "blockgtq": "c2r4t",
    "raq-alloc": "c2q94r4p64",
    "quantmla-raq": "c2q94r4p64",
}


def v2_lite_layer(device: str) -> torch.nn.Module:
    cfg = DeepseekV2Config(
        vocab_size=4096, hidden_size=2048, intermediate_size=1408, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=4096, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, n_group=1, topk_group=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=("bundled", "v2-lite"), default="bundled")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--json", default=None, help="write the timings here")
    ap.add_argument("--progress", action="store_true", help="show the calibration's progress bars (stderr)")
    args = ap.parse_args()
    if args.shape == "bundled":
        model, tok = quantmla.load(device=args.device, dtype=torch.float32)
        text = builtin_text("validation")
    else:
        model, tok = v2_lite_layer(args.device), None
        text = torch.randint(3, 4096, (args.num_seqs + 32, 512), generator=torch.Generator().manual_seed(0))
    quantmla.enable_latent_attention(model)
    adapter = get_adapter(model)
    first = list(adapter.attention_modules(model))[:1]
    rows = {}
    for method in args.methods.split(","):
        scheme = METHODS[method]
        kw = dict(scheme=scheme, method=method, num_seqs=args.num_seqs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        layers = 1
        if method == "quantmla-raq":  # the whole calibration (layer and model stages, two RAQ-MLA fits a layer)
            modules = list(adapter.attention_modules(model))
            layers = len(modules)
            calibrate_model(copy.deepcopy(model), tok, text, progress=args.progress, **kw)
        elif method == "raq-alloc":  # the allocation needs every layer's options: all layers, the time per layer
            modules = list(adapter.attention_modules(model))
            layers = len(modules)
            cfg = CalibrationConfig(**kw)
            train_w, val_w, _ = calibration_windows(tok, text, cfg)
            fit_codec(model, adapter, modules, train_w, val_w, cfg, progress=args.progress)
        elif method in CODEC_METHODS:
            cfg = CalibrationConfig(**kw)
            train_w, val_w, _ = calibration_windows(tok, text, cfg)
            fit_codec(model, adapter, first, train_w, val_w, cfg, progress=args.progress)
        else:
            layer_stage(model, tok, text, layers=[first[0][0]], progress=args.progress, **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        rows[method] = {"scheme": scheme, "seconds_per_layer": (time.perf_counter() - t0) / layers, "layers": layers}
        print(f"| {method} | `{scheme}` | {rows[method]['seconds_per_layer']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "shape": args.shape, "num_seqs": args.num_seqs, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
