"""Issue 18's comparison table, JSON and plot from the result files of scripts/related_methods_gpu.sh (kept in
docs/related-methods-runs/) and the C4R4/C2R4 rows of docs/calibration-results.json (the same protocol), at one
window setting (sink 4 + recent 128, or none: token protection off).

python scripts/related_methods_table.py --results docs/calibration-results.json docs/related-methods-runs/*.json \
    --out docs/related-methods-results.json --plot docs/related-methods-bpe.png
python scripts/related_methods_table.py --windows 0+0 --results docs/calibration-results.json \
    docs/related-methods-runs/nw-*.json --out docs/related-methods-nowindows.json
python scripts/related_methods_table.py --results docs/calibration-results-v3.json docs/related-methods-runs/v3/*.json \
    --out docs/related-methods-results-v3.json --plot docs/related-methods-bpe-v3.png \
    --title "Bundled model v3, float32, H100"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from quantmla.formats.scheme import CacheScheme, PathFormat, parse_scheme  # noqa: E402
from quantmla.models.loading import DEFAULT_MODEL, inspect_model  # noqa: E402

_DIMS = inspect_model(DEFAULT_MODEL).dims  # the bundled model (v2 and v3 share the shape)
D_C, D_R = _DIMS.kv_lora_rank, _DIMS.rope_dim


def bpe(method: str, scheme: str, layers: list[dict] | None) -> float:
    s = parse_scheme(scheme)
    if method == "blockgtq" and layers:  # the per-layer RoPE formats, averaged
        vals = []
        for row in layers:
            rope = parse_scheme(f"c4r{row['rope']['format']}").rope
            vals.append(CacheScheme("x", s.content, PathFormat("int", channel_bits=rope.channel_bits, turbo=True))
                        .bits_per_element(D_C, D_R))  # fmt: skip
        return sum(vals) / len(vals)
    return s.bits_per_element(D_C, D_R)


#: the comparison's three budgets (bits per element); a row belongs to the nearest
BUDGETS = (4.5, 2.9, 2.65)
OURS = ("quantmla", "quantmla-raq", "raq-alloc")
PUBLISHED = ("smoothquant", "quarot", "raq", "rolaq", "blockgtq")


def budget(bpe: float) -> float:
    return 16.0 if bpe > 8 else min(BUDGETS, key=lambda b: abs(b - bpe))


def paired(base: list[float], other: list[float], tokens: int, draws: int = 2000) -> tuple[float, float, float]:
    """Mean ppl difference (other - base) and its 95% paired bootstrap interval over the windows (seed 0)."""
    b, o = torch.tensor(base, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)
    idx = torch.randint(0, len(b), (draws, len(b)), generator=torch.Generator().manual_seed(0))
    diff = torch.exp(o[idx].mean(1) / tokens) - torch.exp(b[idx].mean(1) / tokens)
    lo, hi = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(torch.exp(o.mean() / tokens) - torch.exp(b.mean() / tokens)), lo, hi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--windows", default="4+128", help="sink+recent of the rows to take: 4+128 or 0+0")
    ap.add_argument("--exclude", default="", help="comma list of METHOD/SCHEME rows to leave out")
    ap.add_argument("--title", default="Bundled model v2, float32, H200", help="the plot's model, dtype and card")
    args = ap.parse_args()
    exclude = set(filter(None, args.exclude.split(",")))
    rows = {}
    for f in args.results:
        d = json.loads(f.read_text())
        for r in d["results"]:
            if r["windows"] != args.windows or r.get("dtype", "float32") != "float32" or r["method"].count("/") > 1:
                continue
            if r["method"] in exclude:
                continue
            method = r["method"].split("/")[0]
            # RAQ-MLA's post-RoPE fit at the served context is a variant of the same method and scheme: its own row
            fit = d.get("args", {}).get("rope_fit_seq_len")
            fit = None if fit in (None, "None") else int(fit)
            layer_rows = d.get("layers", {}).get(r["method"])
            seconds = {k: v for k, v in d.get("calibration_seconds", {}).items() if k.split("@")[0] == r["method"]}
            key = r["method"] + ("" if fit is None else f"@rope-fit-{fit}")
            device = d.get("args", {}).get("device", "cuda")
            if key in rows and rows[key]["device"] != "cpu" and device == "cpu":
                continue  # the same run on the H200 and on the CPU: the H200's row
            alloc = d.get("allocations", {}).get(r["method"])  # raq-alloc: the bytes the allocation spent
            rows[key] = {
                "method": method, "scheme": r["scheme"], "rope_fit_seq_len": fit, "device": device,
                "bpe": 8 * alloc["bytes_per_token"] / (D_C + D_R) if alloc else bpe(method, r["scheme"], layer_rows),
                "ppl": r["ppl"], "kl": r["kl"], "niah": r["niah"]["all"], "niah_examples": r["niah"]["examples"],
                "window_nll": r["window_nll"], "tokens_per_window": r["tokens_per_window"],
                "calibration_seconds": sum(seconds.values()) if seconds else None,
            }  # fmt: skip
    for key, r in rows.items():  # paired bootstrap against RTN at the same scheme
        base = rows.get(f"rtn/{r['scheme']}")
        if base is not None and key != f"rtn/{r['scheme']}":
            r["vs_rtn"] = paired(base["window_nll"], r["window_nll"], r["tokens_per_window"])
    for r in rows.values():  # ours against the best published method at the same budget (lowest perplexity)
        rivals = [o for o in rows.values() if o["method"] in PUBLISHED and budget(o["bpe"]) == budget(r["bpe"])]
        if r["method"] in OURS and rivals:
            best = min(rivals, key=lambda o: o["ppl"])
            diff = paired(best["window_nll"], r["window_nll"], r["tokens_per_window"])
            r["vs_best_published"] = {"method": best["method"], "scheme": best["scheme"], "diff": diff}
    out = sorted(rows.values(), key=lambda r: (-budget(r["bpe"]), r["ppl"]))
    args.out.write_text(json.dumps([{k: v for k, v in r.items() if k != "window_nll"} for r in out], indent=1))
    print("| method | scheme | BPE | ppl | KL to unquantised | NIAH | ppl vs RTN, same scheme (95% paired) "
          "| ppl vs best published at the budget (95% paired) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        v, b = r.get("vs_rtn"), r.get("vs_best_published")
        cmp = "" if v is None else f"{v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]"
        best = "" if b is None else (f"{b['diff'][0]:+.4f} [{b['diff'][1]:+.4f}, {b['diff'][2]:+.4f}] vs "
                                     f"{b['method']} `{b['scheme']}`")  # fmt: skip
        name = r["method"] if r["rope_fit_seq_len"] is None else f"{r['method']} (RoPE fit {r['rope_fit_seq_len']})"
        name += " (CPU run)" if r["device"] == "cpu" else ""
        print(f"| {name} | `{r['scheme']}` | {r['bpe']:.2f} | {r['ppl']:.4f} | {r['kl']:.3e} | "
              f"{100 * r['niah']:.1f}% | {cmp} | {best} |")  # fmt: skip
    if args.plot is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for method in sorted({r["method"] for r in out if r["method"] != "bf16"}):
        best: dict[float, tuple] = {}  # a method's best scheme at each of the three budgets
        for r in (r for r in out if r["method"] == method):
            b = budget(r["bpe"])
            if b not in best or r["ppl"] < best[b][1]:
                best[b] = (r["bpe"], r["ppl"], r["kl"], r["device"])
        pts = sorted(best.values())
        for i, key in ((0, 1), (1, 2)):
            (line,) = ax[i].plot([p[0] for p in pts], [p[key] for p in pts], "-", label=method)
            for p in pts:  # a CPU run's point hollow: the title's device is the H200
                face = "none" if p[3] == "cpu" else line.get_color()
                ax[i].plot(p[0], p[key], "o", color=line.get_color(), markerfacecolor=face)
    ax[0].set(xlabel="bits per cached element (metadata included)", ylabel="perplexity (test split, 4K windows)")
    ax[1].set(xlabel="bits per cached element (metadata included)", ylabel="KL to the unquantised cache", yscale="log")
    ax[0].legend(fontsize=7)
    title = f"{args.title} (hollow: a CPU run), sink 4 + recent 128: each method's best scheme per budget"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
