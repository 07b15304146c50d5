"""Issue-5 results on the bundled model: methods x schemes x sink/recent, the ablation, per-layer errors.

python scripts/calibration_results.py --out out/calib            # paper recipe, everything, one process
python scripts/calibration_results.py --out out/p1 --runs bf16,rtn/c4r4  # a subset (run parts side by side)
python scripts/calibration_results.py --out out/calib --merge out/p1 out/p2 ...  # one table and plot
python scripts/calibration_results.py --out out/r --runs raq/c2g128q94r4p128,blockgtq/c4r4t  # any METHOD/SCHEME

QuantMLA's layer stage split over processes (layers are independent), then the runs that reuse it:
python scripts/calibration_results.py --out out/s0 --runs quantmla/c4r4 --layer-stages out/stages \
    --layer-stage-only --stage-layers 0,1        # ... one process per subset; the parts are merged
python scripts/calibration_results.py --out out/q --runs quantmla/c4r4 --layer-stages out/stages
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import quantmla
from quantmla.calibrate import (
    QUANTMLA_METHODS,
    CalibrationConfig,
    LayerStage,
    calibrate_model,
    layer_stage,
    merge_layer_stages,
)
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.eval.niah import NiahConfig, accuracy, run_niah
from quantmla.models.loading import builtin_text
from quantmla.transforms.fuse import RopeTransform

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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
    ap.add_argument("--eval-seq-len", type=int, default=4096, help="tokens per evaluated test window")
    ap.add_argument("--niah", type=int, default=0,
                    help="also NIAH (niah-1/2/3, 1K/2K/4K, depths 0-100%% by 25) with N examples per cell")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                    help="the model's dtype for calibration and evaluation (recorded in every row)")  # fmt: skip
    ap.add_argument("--runs", default=",".join(ALL_RUNS), help=f"comma list of: {', '.join(ALL_RUNS)}")
    ap.add_argument("--merge", type=Path, nargs="+", help="merge the results.json of these output folders")
    ap.add_argument("--seed", type=int, default=0, help="calibration seed (the random Hadamard draws)")
    ap.add_argument("--windows", choices=("both", "with", "without"), default="both",
                    help="evaluate with sink 4 + recent 128, without, or both")  # fmt: skip
    ap.add_argument("--model-steps", type=int, default=150, help="QuantMLA's model-level steps (0: layer stage only)")
    ap.add_argument("--model-rotation-lr", type=float, default=None,
                    help="QuantMLA's model-level rate for the content rotations (default: width-scaled)")  # fmt: skip
    ap.add_argument("--model-seq-len", type=int, default=None,
                    help="tokens per sequence of QuantMLA's model-level stage (default: --seq-len)")  # fmt: skip
    ap.add_argument(
        "--rope-fit-seq-len",
        type=int,
        default=None,
        help="tokens per window of RAQ-MLA's post-RoPE fit (raq, quantmla-raq; default: --model-seq-len)",
    )
    ap.add_argument("--layer-stages", type=Path, default=None,
                    help="folder of QuantMLA layer stages: reused when there, saved when not")  # fmt: skip
    ap.add_argument("--layer-stage-only", action="store_true",
                    help="only compute and save the QuantMLA layer stages (into --layer-stages)")  # fmt: skip
    ap.add_argument("--stage-layers", default=None,
                    help="with --layer-stage-only: only these cache indices (comma list), saved as a part")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args.merge, args.out)
    wanted = args.runs.split(",")
    bad = [r for r in wanted if r not in ALL_RUNS and not _method_scheme(r)]
    if bad:
        raise SystemExit(f"--runs: unknown {bad}; valid: {', '.join(ALL_RUNS)}, or any METHOD/SCHEME")
    base, tok = quantmla.load(device=args.device, dtype=DTYPES[args.dtype])
    quantmla.enable_latent_attention(base)
    calib_text, test_text = builtin_text("validation"), builtin_text("test")
    results, layers, times, allocations = [], {}, {}, {}

    def evaluate(model, scheme, sink, recent) -> dict:
        cfg = PerplexityConfig(
            scheme=scheme, seq_len=args.eval_seq_len, num_seqs=args.eval_seqs, sink=sink, recent=recent,
            batch_size=max(1, 8192 // args.eval_seq_len), kl=True, per_window=True,
        )  # fmt: skip
        r = perplexity(model, tok, test_text, cfg, progress=False)
        out = {"ppl": r.ppl, "kl": r.kl, "window_nll": r.window_nll, "tokens_per_window": r.tokens // r.sequences}
        if args.niah > 0:
            ncfg = NiahConfig(num_examples=args.niah, sink=sink, recent=recent)
            rows = run_niah(model, tok, test_text, [scheme], ncfg, progress=False)
            out["niah"] = {"all": accuracy(rows), **{t: accuracy(rows, task=t) for t in ncfg.tasks},
                           "examples": len(rows)}  # fmt: skip
        return {"dtype": args.dtype, **out}

    def dump() -> None:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "layers": layers}
        data["calibration_seconds"] = times
        data["allocations"] = allocations
        (args.out / "results.json").write_text(json.dumps(data, indent=1))

    settings = {"both": ((4, 128), (0, 0)), "with": ((4, 128),), "without": ((0, 0),)}[args.windows]
    if "bf16" in wanted and not args.layer_stage_only:
        results.append({"method": "bf16", "scheme": "bf16", "windows": "4+128", **evaluate(base, "bf16", 4, 128)})
        dump()
    for tag in wanted:
        if tag == "bf16":
            continue
        method, scheme, *only = tag.split("/")
        paths = tuple(only) if only else ("content", "rope")
        if args.layer_stage_only and method not in QUANTMLA_METHODS:
            continue
        stage_file = None  # only QuantMLA has a layer stage to save or reuse
        if args.layer_stages is not None and method in QUANTMLA_METHODS:  # quantmla-raq starts from the same stage
            stage_file = args.layer_stages / f"{scheme}-{'+'.join(paths)}.pt"
        if args.stage_layers is not None:  # one part of the layer stage, merged when every part is there
            if not (args.layer_stage_only and stage_file is not None):
                raise SystemExit("--stage-layers needs --layer-stage-only and --layer-stages")
            subset = [int(i) for i in args.stage_layers.split(",")]
            t0 = time.perf_counter()
            part = layer_stage(
                base, tok, calib_text, layers=subset, scheme=scheme, method=method, steps=args.steps,
                num_seqs=args.num_seqs, val_seqs=args.val_seqs, seq_len=args.seq_len, paths=paths, seed=args.seed,
            )  # fmt: skip
            times[f"{tag}:layer-stage:{args.stage_layers}"] = time.perf_counter() - t0
            stage_file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(part, stage_file.with_suffix(f".layers-{'_'.join(map(str, subset))}.pt"))
            dump()
            continue
        stage = load_stage(stage_file) if stage_file is not None else None
        if stage is None and method == "quantmla" and paths == ("content",) and args.layer_stages is not None:
            full = args.layer_stages / f"{scheme}-content+rope.pt"
            if full.exists():  # the ablation: the same learned content transforms, no RoPE transform
                key = CalibrationConfig(
                    scheme=scheme, method=method, steps=args.steps, num_seqs=args.num_seqs, val_seqs=args.val_seqs,
                    seq_len=args.seq_len, paths=paths, seed=args.seed,
                ).layer_key()  # fmt: skip
                stage = content_only(torch.load(full, weights_only=False), key)
        # the baselines do not depend on the windows (calibrate once); QuantMLA's model-level stage does
        calibrations = [(s, [s]) for s in settings] if method in QUANTMLA_METHODS else [(settings[0], list(settings))]
        for (c_sink, c_recent), evals in calibrations:
            t0 = time.perf_counter()
            model, rep = calibrate_model(
                copy.deepcopy(base), tok, calib_text, progress=True, layer_stage=stage, scheme=scheme,
                method=method, steps=args.steps, num_seqs=args.num_seqs, val_seqs=args.val_seqs,
                seq_len=args.seq_len, paths=paths, seed=args.seed, sink=c_sink, recent=c_recent,
                model_steps=0 if args.layer_stage_only else args.model_steps, model_seq_len=args.model_seq_len,
                model_rotation_lr=args.model_rotation_lr,
                rope_fit_seq_len=args.rope_fit_seq_len,
            )  # fmt: skip
            key = tag if method not in QUANTMLA_METHODS else f"{tag}@{c_sink}+{c_recent}"
            times[key] = time.perf_counter() - t0
            layers[key] = rep.layers
            if rep.allocation is not None:  # raq-alloc: the formats it gave each layer, and why
                allocations[key] = rep.allocation
            if method in QUANTMLA_METHODS and stage is None:
                stage = rep.layer_stage
                times[f"{tag}:layer-stage"] = times[key]
                if stage_file is not None:
                    stage_file.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(stage, stage_file)
            if args.layer_stage_only:
                dump()  # the layer stage's time
                break
            for sink, recent in evals:
                row = {
                    "method": tag,
                    "scheme": scheme,
                    "windows": f"{sink}+{recent}",
                    **evaluate(model, scheme if rep.codec is None else rep.codec, sink, recent),
                }
                row["model_level"] = rep.model_level
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("window_nll", "model_level")}), flush=True)
            dump()  # after every run, so a run cut short keeps what it finished
    if not args.layer_stage_only:
        plot(layers, args.out / "layer_errors.png")


def _method_scheme(tag: str) -> bool:
    """Whether ``tag`` is ``METHOD/SCHEME`` with a calibration method and a scheme it calibrates."""
    method, _, scheme = tag.partition("/")
    try:
        CalibrationConfig(scheme=scheme, method=method)
    except ValueError:
        return False
    return True


def load_stage(stage_file: Path) -> LayerStage | None:
    """The saved layer stage, or the merge of its saved parts (saved whole then); ``None`` if neither."""
    if stage_file.exists():
        return torch.load(stage_file, weights_only=False)
    parts = sorted(stage_file.parent.glob(f"{stage_file.stem}.layers-*.pt"))
    if not parts:
        return None
    stage = merge_layer_stages([torch.load(p, weights_only=False) for p in parts])
    print(f"layer stage {stage_file.name}: merged {len(parts)} parts, layers {stage.layers}", flush=True)
    torch.save(stage, stage_file)
    return stage


def content_only(full: LayerStage, key: tuple) -> LayerStage:
    """The ablation's layer stage from the full one: the same content transforms, the RoPE path untouched."""
    rows = []
    for r in full.rows:
        v = r["rope"]["val_before"]
        rows.append(
            {**r, "rope": {"val_before": v, "init": "original", "candidate_val": {"original": v}, "val_after": v}}
        )
    chosen = {}
    for idx, (ct, rt) in full.chosen.items():
        zeros = torch.zeros_like(rt.angles)
        chosen[idx] = (ct, RopeTransform(zeros, zeros.clone()))
    candidates = {idx: (c, {}) for idx, (c, _r) in full.candidates.items()}
    return LayerStage(key, full.data_sha256, rows, chosen, candidates)


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
    merged["paired"] = paired_differences(merged["results"])
    (out / "results.json").write_text(json.dumps(merged, indent=1))
    plot(merged["layers"], out / "layer_errors.png")
    head = ("method", "scheme", "dtype", "ppl, sink 4 + recent 128", "ppl, no windows", "KL, sink 4 + recent 128",
            "KL, no windows", "NIAH, sink 4 + recent 128", "NIAH, no windows")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for tag in ALL_RUNS:
        rows = {r["windows"]: r for r in merged["results"] if r["method"] == tag}
        if rows:
            ppl = [f"{rows[w]['ppl']:.3f}" if w in rows else "" for w in ("4+128", "0+0")]
            kl = [f"{rows[w]['kl']:.2e}" if w in rows and rows[w].get("kl") else "" for w in ("4+128", "0+0")]
            kl += [f"{100 * rows[w]['niah']['all']:.1f}%" if w in rows and rows[w].get("niah") else ""
                   for w in ("4+128", "0+0")]  # fmt: skip
            scheme = "bf16" if tag == "bf16" else tag.split("/")[1]
            dtype = next(iter(rows.values())).get("dtype", merged["args"].get("dtype", "float32"))
            print(f"| {tag} | {scheme} | {dtype} | " + " | ".join(ppl + kl) + " |")
    print("\nPaired bootstrap over test windows, QuantMLA minus each baseline (ppl; 95% interval):")
    for p in merged["paired"]:
        ci = f"[{p['lo']:+.4f}, {p['hi']:+.4f}]"
        print(f"  {p['scheme']} {p['windows']:6s} vs {p['baseline']:12s} {p['diff']:+.4f} {ci}")


def paired_differences(results: list[dict], draws: int = 2000) -> list[dict]:
    """ppl(QuantMLA) - ppl(baseline) with a 95% paired bootstrap interval over the test windows."""
    import math

    out = []
    gen = torch.Generator().manual_seed(0)
    for ours in results:
        if not ours["method"].startswith("quantmla/") or ours["method"].count("/") != 1:
            continue
        scheme, windows = ours["scheme"], ours["windows"]
        a = torch.tensor(ours["window_nll"], dtype=torch.float64)
        for theirs in results:
            if theirs["scheme"] != scheme or theirs["windows"] != windows or theirs["method"].startswith("quantmla"):
                continue
            b = torch.tensor(theirs["window_nll"], dtype=torch.float64)
            tokens = ours["tokens_per_window"] if "tokens_per_window" in ours else 511
            idx = torch.randint(0, len(a), (draws, len(a)), generator=gen)
            diffs = (a[idx].sum(1) / (len(a) * tokens)).exp() - (b[idx].sum(1) / (len(a) * tokens)).exp()
            lo, hi = torch.quantile(diffs, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
            diff = math.exp(a.sum().item() / (len(a) * tokens)) - math.exp(b.sum().item() / (len(a) * tokens))
            out.append({"scheme": scheme, "windows": windows, "baseline": theirs["method"].split("/")[0],
                        "diff": diff, "lo": lo, "hi": hi})  # fmt: skip
    return out


def plot(layers: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("content", "rope"), strict=True):
        for tag, rows in layers.items():
            name = tag.split("@")[0]
            if tag.endswith("@4+128") or not (name.endswith("c4r4") or name.endswith("c2r4")):
                continue  # one curve per method and scheme (QuantMLA: its no-window calibration)
            style = "-" if name.endswith("c4r4") else "--"
            if any("val_after" not in r[kind] for r in rows):
                continue  # a path the method only formats (Block-GTQ's RoPE widths, RoLaQ's RoPE key)
            ys = [r[kind].get("val_final", r[kind]["val_after"]) for r in rows]
            ax.plot([r["layer"] for r in rows], ys, "o" + style, label=name)
        ax.set_yscale("log")
        ax.set_title(f"{kind} path: held-out layer error after calibration")
        ax.set_xlabel("layer")
    axes[0].set_ylabel("normalised error (held-out)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})


if __name__ == "__main__":
    main()
