"""Issue-5 results on the bundled model: methods x schemes x sink/recent, the ablation, per-layer errors.

python scripts/calibration_results.py --out out/calib            # paper recipe, everything, one process
python scripts/calibration_results.py --out out/p1 --runs bf16,rtn/c4r4  # a subset (run parts side by side)
python scripts/calibration_results.py --out out/calib --merge out/p1 out/p2 ...  # one table and plot
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

ALL_RUNS = (
    "bf16",
    *(f"{m}/{s}" for s in ("c4r4", "c2r4") for m in ("rtn", "smoothquant", "quarot", "quantmla")),
    "quantmla/c4r4/content",  # ablation: + content transform only
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out/calib"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--val-seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-seqs", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runs", default=",".join(ALL_RUNS), help=f"comma list of: {', '.join(ALL_RUNS)}")
    ap.add_argument("--merge", type=Path, nargs="+", help="merge the results.json of these output folders")
    ap.add_argument("--seed", type=int, default=0, help="calibration seed (the random Hadamard draws)")
    ap.add_argument("--windows", choices=("both", "with", "without"), default="both",
                    help="evaluate with sink 4 + recent 128, without, or both")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args.merge, args.out)
    wanted = args.runs.split(",")
    bad = [r for r in wanted if r not in ALL_RUNS]
    if bad:
        raise SystemExit(f"--runs: unknown {bad}; valid: {', '.join(ALL_RUNS)}")
    base, tok = quantmla.load(device=args.device)
    quantmla.enable_latent_attention(base)
    calib_text, test_text = builtin_text("validation"), builtin_text("test")
    results, layers, times = [], {}, {}

    def ppl(model, scheme, sink, recent):
        cfg = PerplexityConfig(
            scheme=scheme, seq_len=512, num_seqs=args.eval_seqs, sink=sink, recent=recent, batch_size=16
        )
        return perplexity(model, tok, test_text, cfg, progress=False).ppl

    def dump() -> None:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "layers": layers}
        data["calibration_seconds"] = times
        (args.out / "results.json").write_text(json.dumps(data, indent=1))

    if "bf16" in wanted:
        results.append({"method": "bf16", "scheme": "bf16", "windows": "4+128", "ppl": ppl(base, "bf16", 4, 128)})
        dump()
    for tag in wanted:
        if tag == "bf16":
            continue
        method, scheme, *only = tag.split("/")
        paths = tuple(only) if only else ("content", "rope")
        t0 = time.perf_counter()
        model, rep = calibrate(
            copy.deepcopy(base),
            tok,
            calib_text,
            progress=True,
            scheme=scheme,
            method=method,
            steps=args.steps,
            num_seqs=args.num_seqs,
            val_seqs=args.val_seqs,
            seq_len=args.seq_len,
            paths=paths,
            seed=args.seed,
        )
        times[tag] = time.perf_counter() - t0
        layers[tag] = rep.layers
        settings = {"both": ((4, 128), (0, 0)), "with": ((4, 128),), "without": ((0, 0),)}[args.windows]
        for sink, recent in settings:
            results.append(
                {
                    "method": tag,
                    "scheme": scheme,
                    "windows": f"{sink}+{recent}",
                    "ppl": ppl(model, scheme, sink, recent),
                }
            )
            print(json.dumps(results[-1]), flush=True)
        dump()  # after every run, so a run cut short keeps what it finished
    plot(layers, args.out / "layer_errors.png")


def merge(parts: list[Path], out: Path) -> None:
    merged = {"args": None, "results": [], "layers": {}, "calibration_seconds": {}}
    for part in parts:
        d = json.loads((part / "results.json").read_text())
        merged["args"] = merged["args"] or d["args"]
        merged["results"] += d["results"]
        merged["layers"].update(d["layers"])
        merged["calibration_seconds"].update(d["calibration_seconds"])
    order = {t: i for i, t in enumerate(ALL_RUNS)}
    merged["results"].sort(key=lambda r: (order[r["method"]], r["windows"] != "4+128"))
    (out / "results.json").write_text(json.dumps(merged, indent=1))
    plot(merged["layers"], out / "layer_errors.png")
    print("| method | scheme | sink 4 + recent 128 | no windows | calibration s |")
    print("|---|---|---|---|---|")
    for tag in ALL_RUNS:
        rows = {r["windows"]: r["ppl"] for r in merged["results"] if r["method"] == tag}
        if rows:
            secs = merged["calibration_seconds"].get(tag)
            cells = [f"{rows[w]:.3f}" if w in rows else "" for w in ("4+128", "0+0")]
            print(
                f"| {tag} | {tag.split('/')[-1] if tag == 'bf16' else tag.split('/')[1]} | "
                + " | ".join(cells)
                + f" | {'' if secs is None else f'{secs:.0f}'} |"
            )


def plot(layers: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("content", "rope"), strict=True):
        for tag, rows in layers.items():
            if tag.endswith("c4r4") or tag.endswith("c2r4"):
                style = "-" if tag.endswith("c4r4") else "--"
                ax.plot([r["layer"] for r in rows], [r[kind]["val_after"] for r in rows], "o" + style, label=tag)
        ax.set_yscale("log")
        ax.set_title(f"{kind} path: held-out layer error after calibration")
        ax.set_xlabel("layer")
    axes[0].set_ylabel("normalised error (held-out)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})


if __name__ == "__main__":
    main()
