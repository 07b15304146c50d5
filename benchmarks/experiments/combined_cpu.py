"""Experiment: the combined method (quantmla-raq) against RAQ-MLA and QuantMLA at one budget, on CPU, with a
reduced recipe (the device time of the session that built it was spent): calibration on 32 + 8 sequences of 512
tokens, QuantMLA's layer stage 50 steps and model stage 30, evaluation on `quantmla eval ppl`'s default subset
(6 x 4,096 test tokens spread over the split), sink 4 + recent 128, KL to the unquantised cache, paired bootstrap.

    python benchmarks/experiments/combined_cpu.py --scheme c2g128q94r4t
    python benchmarks/experiments/combined_cpu.py --scheme c2g128q94r4t --methods rtn,raq --model-seq-len 4096
    python benchmarks/experiments/combined_cpu.py --scheme c2g128q94r4p128 --methods rtn,raq,quantmla-raq \
        --rope-fit-seq-len 4096
    python benchmarks/experiments/combined_cpu.py --scheme c2q94r4p64 --methods rtn,raq,raq-alloc \
        --rope-fit-seq-len 4096
    python benchmarks/experiments/combined_cpu.py --scheme c4r4 --methods rtn,smoothquant,raq-alloc \
        --rope-fit-seq-len 4096
    python benchmarks/experiments/combined_cpu.py --scheme c2q94r4p64 --methods raq,raq-alloc \
        --rope-fit-seq-len 4096 --no-windows
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import quantmla
from quantmla.calibrate import calibrate_model
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.eval.ppl import paired_bootstrap
from quantmla.models.loading import builtin_text

RECIPE = dict(num_seqs=32, val_seqs=8, seq_len=512, steps=50, model_steps=30, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="c2g128q94r4t")
    ap.add_argument("--methods", default="rtn,raq,quantmla,quantmla-raq")
    ap.add_argument("--model-seq-len", type=int, default=None, help="calibrate's --model-seq-len (e.g. 4096)")
    ap.add_argument("--rope-fit-seq-len", type=int, default=None, help="calibrate's --rope-fit-seq-len (e.g. 4096)")
    ap.add_argument("--no-windows", action="store_true", help="token protection off: no sink, no recent window")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base, tok = quantmla.load(dtype=torch.float32)
    quantmla.enable_latent_attention(base)
    calib, test = builtin_text("validation"), builtin_text("test")
    windows = {"sink": 0, "recent": 0} if args.no_windows else {"sink": 4, "recent": 128}
    rows = {}
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        model, rep = calibrate_model(copy.deepcopy(base), tok, calib, scheme=args.scheme, method=method,
                                     model_seq_len=args.model_seq_len, rope_fit_seq_len=args.rope_fit_seq_len,
                                     **windows, **RECIPE)  # fmt: skip
        secs = time.perf_counter() - t0
        cfg = PerplexityConfig(scheme=args.scheme if rep.codec is None else rep.codec, seq_len=4096, num_seqs=6,
                               spread=True, kl=True, per_window=True, batch_size=2, **windows)  # fmt: skip
        r = perplexity(model, tok, test, cfg, progress=False)
        rows[method] = {"ppl": r.ppl, "kl": r.kl, "bpe": r.bits_per_element, "calibration_s": secs,
                        "window_nll": r.window_nll, "allocation": rep.allocation}  # fmt: skip
        shown = {k: v for k, v in rows[method].items() if k not in ("window_nll", "allocation")}
        if rep.allocation is not None:
            shown["schemes"] = rep.allocation["schemes"]
        print(json.dumps(shown | {"method": method}), flush=True)
    print("| method | scheme | BPE | ppl | KL | vs RTN (paired 95%) | calibration (s, CPU) |")
    print("|---|---|---|---|---|---|---|")
    for m, r in rows.items():
        cmp = ""
        if m != "rtn" and "rtn" in rows:
            lo, hi = paired_bootstrap(rows["rtn"]["window_nll"], r["window_nll"], 4095)
            cmp = f"{100 * (r['ppl'] / rows['rtn']['ppl'] - 1):+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"
        print(f"| {m} | `{args.scheme}` | {r['bpe']:.2f} | {r['ppl']:.4f} | {r['kl']:.3e} | {cmp} | "
              f"{r['calibration_s']:.0f} |")  # fmt: skip
    for m in ("quantmla-raq", "raq-alloc"):
        if "raq" in rows and m in rows:
            a, b = rows["raq"], rows[m]
            lo, hi = paired_bootstrap(a["window_nll"], b["window_nll"], 4095)
            print(f"{m} vs raq: {100 * (b['ppl'] / a['ppl'] - 1):+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
