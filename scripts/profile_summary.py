"""Summarise the torch profiler traces of ``benchmarks/serving_pressure.py --profile-dir DIR``: per scheme (a
subfolder of DIR), vLLM's engine steps split into decode-only steps and steps with a prefill, each with its GPU
span, the kernels' time inside it and the largest kernels.

    python scripts/profile_summary.py DIR_OR_TRACE [--top 12] [--json OUT.json] [--each]

DIR holds one subfolder per scheme (the profiler's layout); a single ``*.json.gz`` trace works too.
vLLM (0.26) marks each step on the GPU timeline as ``execute_context_N(T)_generation_M(G)``: N requests
prefilling T tokens, M decoding. A kernel belongs to the step whose span holds its start. ``--each`` also
gives, per step, its GPU operations (kernels, copies, memsets) and the host's side: the same annotation on
the CPU timeline, the CUDA runtime calls inside it, and when the host finished issuing the step after the
GPU finished the previous one.
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

GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")
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
    gpu_ops = [0] * len(marks)  # kernels, copies and memsets
    for e in spans:
        if e.get("cat") not in GPU_OPS:
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > starts[i] + marks[i]["dur"]:
            continue  # between steps
        gpu_ops[i] += 1
        if e["cat"] != "kernel":
            continue
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
                "kernels": sum(v[1] for v in per_step[i].values()),
                "gpu_ops": gpu_ops[i],
            }
            for i, m in enumerate(marks)
        ],
    }
    add_host_side(spans, marks, out["each"])
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


def add_host_side(spans: list[dict], gpu_marks: list[dict], each: list[dict]) -> None:
    """Adds to each step the host's annotation of it (matched in order; skipped when the counts differ or the
    trace has only one timeline): ``host_start_us`` (from the first GPU step's start), ``host_span_us``,
    ``host_runtime_calls`` (CUDA runtime calls that start inside it) and ``host_issue_end_after_previous_gpu_end_us``
    (the host's end of this step minus the GPU's end of the previous one)."""
    host = sorted(
        (e for e in spans if e.get("cat") == "user_annotation" and STEP.match(str(e.get("name", "")))),
        key=lambda e: e["ts"],
    )
    if len(host) != len(gpu_marks) or gpu_marks[0].get("cat") != "gpu_user_annotation":  # all or none are
        return
    t0 = gpu_marks[0]["ts"]
    calls = sorted(e["ts"] for e in spans if e.get("cat") == "cuda_runtime")
    for i, (h, row) in enumerate(zip(host, each, strict=True)):
        end = h["ts"] + h["dur"]
        row["host_start_us"] = h["ts"] - t0
        row["host_span_us"] = h["dur"]
        row["host_runtime_calls"] = bisect.bisect_right(calls, end) - bisect.bisect_left(calls, h["ts"])
        prev = gpu_marks[i - 1] if i else None
        row["host_issue_end_after_previous_gpu_end_us"] = None if prev is None else end - prev["ts"] - prev["dur"]


def traces(root: Path) -> list[tuple[str, Path]]:
    """(label, trace) pairs: a single trace file, or each scheme subfolder's traces."""
    if not root.exists():
        raise SystemExit(f"no such trace or folder: {root} (give the --profile-dir folder or one *.json.gz trace)")
    if root.is_file():
        return [(root.name.split(".")[0], root)]
    return [
        (sub.name, path)
        for sub in sorted(p for p in root.iterdir() if p.is_dir())
        for path in sorted(sub.glob("*.json.gz")) + sorted(sub.glob("*.json"))
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--each", action="store_true", help="also each step: its GPU span, kernels and the host's side")
    args = ap.parse_args()
    out = {}
    for label, path in traces(args.dir):
        try:
            s = summarise(load_events(path), args.top)
        except ValueError:  # the front end's or another process's trace
            continue
        out[f"{label}/{path.name}"] = s
        print(f"== {label} ({path.name}): {len(s['steps'])} steps")
        for e in s["each"] if args.each else ():
            gap = e.get("host_issue_end_after_previous_gpu_end_us")
            host = "" if gap is None else f"  host issued {gap / 1e3:7.2f} ms after the previous GPU step"
            print(
                f"   {e['start_us'] / 1e3:9.2f} ms  span {e['gpu_span_us'] / 1e3:8.2f} ms  kernels"
                f" {e['kernel_us'] / 1e3:8.2f} ms, {e['gpu_ops']:5d} GPU ops{host}  {e['name']}"
            )
        for group in ("decode", "prefill"):
            if group not in s:
                continue
            g = s[group]
            period = "" if g["step_period_us"] is None else f", a step every {g['step_period_us']:.0f} us"
            print(f" {group}: {g['steps']} steps{period}, GPU span {g['gpu_span_us_per_step']:.0f} us a step, "
                  f"kernels {g['kernel_us_per_step']:.0f} us a step")  # fmt: skip
            for k in g["kernels"]:
                print(f"   {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.1f}  {k['name'][:110]}")
    if not out:
        raise SystemExit(f"no vLLM worker trace (execute_context_* step annotations) under {args.dir}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
