"""Issue-5 results on the bundled model: methods x schemes x sink/recent, the ablation, per-layer errors.

python scripts/calibration_results.py --out out/calib --steps 60 --num-seqs 16 --seq-len 256 --eval-seqs 64
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import quantmla
from quantmla.calibrate import calibrate
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.models.loading import builtin_text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out/calib"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--val-seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-seqs", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base, tok = quantmla.load(device=args.device)
    quantmla.enable_latent_attention(base)
    calib_text, test_text = builtin_text("validation"), builtin_text("test")
    results, layers, times = [], {}, {}

    def ppl(model, scheme, sink, recent):
        cfg = PerplexityConfig(
            scheme=scheme, seq_len=512, num_seqs=args.eval_seqs, sink=sink, recent=recent, batch_size=16
        )
        return perplexity(model, tok, test_text, cfg, progress=False).ppl

    results.append({"method": "bf16", "scheme": "bf16", "windows": "4+128", "ppl": ppl(base, "bf16", 4, 128)})
    runs = [(m, s, ("content", "rope")) for s in ("c4r4", "c2r4") for m in ("rtn", "smoothquant", "quarot", "quantmla")]
    runs.append(("quantmla", "c4r4", ("content",)))  # ablation: + content transform only
    for method, scheme, paths in runs:
        t0 = time.perf_counter()
        model, rep = calibrate(
            copy.deepcopy(base),
            tok,
            calib_text,
            progress=False,
            scheme=scheme,
            method=method,
            steps=args.steps,
            num_seqs=args.num_seqs,
            val_seqs=args.val_seqs,
            seq_len=args.seq_len,
            paths=paths,
        )
        tag = f"{method}/{scheme}" + ("" if len(paths) == 2 else "/" + "+".join(paths))
        times[tag] = time.perf_counter() - t0
        layers[tag] = rep.layers
        for sink, recent in ((4, 128), (0, 0)):
            results.append(
                {
                    "method": tag,
                    "scheme": scheme,
                    "windows": f"{sink}+{recent}",
                    "ppl": ppl(model, scheme, sink, recent),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "results": results,
                "layers": layers,
                "calibration_seconds": times,
            },
            indent=1,
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, path in zip(axes, ("content", "rope"), strict=True):
        for tag, rows in layers.items():
            if tag.endswith("c4r4") or tag.endswith("c2r4"):
                ax.plot([r["layer"] for r in rows], [r[path]["val_after"] for r in rows], "o-", label=tag)
        ax.set_yscale("log")
        ax.set_title(f"{path}: validation error after calibration")
        ax.set_xlabel("layer")
    axes[0].set_ylabel("normalised error (held-out)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "layer_errors.png", dpi=110, metadata={"Software": None})


if __name__ == "__main__":
    main()
