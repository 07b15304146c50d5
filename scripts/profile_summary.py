"""Summarise the torch profiler traces of ``benchmarks/serving_pressure.py --profile-dir DIR``: per scheme (a
subfolder of DIR), vLLM's engine steps split into decode-only steps and steps with a prefill, each with its GPU
span, the kernels' time inside it and the largest kernels.

    python scripts/profile_summary.py DIR [--top 12] [--json OUT.json] [--each]

vLLM (0.26) marks each step on the GPU timeline as ``execute_context_N(T)_generation_M(G)``: N requests
prefilling T tokens, M decoding. A kernel belongs to the step whose span holds its start.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def summarise(events: list[dict], top: int) -> dict:
    """Per group of steps (``decode``: no request prefilling; ``prefill``: the others) the step count, the median
    gap between consecutive steps' starts, the mean GPU span and kernel time a step, and the ``top`` kernels (us
    and launches a step)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    marks = [e for e in spans if STEP.match(str(e.get("name", "")))]
    gpu_marks = [e for e in marks if e.get("cat") == "gpu_user_annotation"]
    marks = sorted(gpu_marks or marks, key=lambda e: e["ts"])
    if not marks:
        raise ValueError("no execute_context_*_generation_* step annotation in the trace: not a vLLM worker's trace")
    starts = [e["ts"] for e in marks]
    per_step = [defaultdict(lambda: [0.0, 0]) for _ in marks]
    for e in spans:
        if e.get("cat") != "kernel":
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > starts[i] + marks[i]["dur"]:
            continue  # between steps
        k = per_step[i][e["name"]]
        k[0] += e["dur"]
        k[1] += 1
    out = {
        "steps": [m["name"] for m in marks],
        "each": [
            {
                "name": m["name"],
                "start_us": m["ts"] - starts[0],
                "gpu_span_us": m["dur"],
                "kernel_us": sum(v[0] for v in per_step[i].values()),
            }
            for i, m in enumerate(marks)
        ],
    }
    for label in ("decode", "prefill"):
        idx = [i for i, m in enumerate(marks) if (int(STEP.match(m["name"])[1]) == 0) == (label == "decode")]
        if not idx:
            continue
        gaps = [starts[i + 1] - starts[i] for i in idx if i + 1 in idx]
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for i in idx:
            for name, (us, n) in per_step[i].items():
                total[name][0] += us
                total[name][1] += n
        n = len(idx)
        ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
        out[label] = {
            "steps": n,
            "step_period_us": statistics.median(gaps) if gaps else None,
            "gpu_span_us_per_step": sum(marks[i]["dur"] for i in idx) / n,
            "kernel_us_per_step": sum(v[0] for v in total.values()) / n,
            "kernels": [{"name": k, "us_per_step": v[0] / n, "launches_per_step": v[1] / n} for k, v in ranked],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--each", action="store_true", help="also each step: its start, GPU span and kernel time")
    args = ap.parse_args()
    out = {}
    for sub in sorted(p for p in args.dir.iterdir() if p.is_dir()):
        for path in sorted(sub.glob("*.json.gz")) + sorted(sub.glob("*.json")):
            try:
                s = summarise(load_events(path), args.top)
            except ValueError:  # the front end's or another process's trace
                continue
            out[f"{sub.name}/{path.name}"] = s
            print(f"== {sub.name} ({path.name}): {len(s['steps'])} steps")
            for e in s["each"] if args.each else ():
                print(
                    f"   {e['start_us'] / 1e3:9.2f} ms  span {e['gpu_span_us'] / 1e3:8.2f} ms  kernels"
                    f" {e['kernel_us'] / 1e3:8.2f} ms  {e['name']}"
                )
            for label in ("decode", "prefill"):
                if label not in s:
                    continue
                g = s[label]
                period = "" if g["step_period_us"] is None else f", a step every {g['step_period_us']:.0f} us"
                print(f" {label}: {g['steps']} steps{period}, GPU span {g['gpu_span_us_per_step']:.0f} us a step, "
                      f"kernels {g['kernel_us_per_step']:.0f} us a step")  # fmt: skip
                for k in g["kernels"]:
                    print(f"   {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.1f}  {k['name'][:110]}")
    if not out:
        raise SystemExit(f"no vLLM worker trace (execute_context_* step annotations) under {args.dir}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
