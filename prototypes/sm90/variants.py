"""Variants of the sm_90a decode kernel side by side on one GPU (an experiment, not part of the package).

Each variant is the kernel's source with compile-time switches (``-D...``), or the source of a git commit
(``@<rev>``), built as its own extension (the builds in parallel) and run in its own process (one extension a
process: the variants export the same symbols) in place of ``quantmla.kernels.hopper``'s build. Every variant is
timed on the same seeded stores (CUDA graph replay, do_bench median, L2 flushed), FlashMLA's BF16 decode in a
process of its own, and each output is compared with the first variant's.

usage (on the device): PYTHONPATH=src:benchmarks python prototypes/sm90/variants.py --flashmla-lib .data/flashmla
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CSRC = "src/quantmla/kernels/hopper/csrc"
FILES = ("binding.cpp", "decode_sm90.cu", "decode_sm90.h", "sm90_ops.cuh", "wgmma_ops.cuh")
VARIANTS = {  # name: "@<git rev> [flags]" (that commit's sources) or "[flags]" (the working tree's)
    "head": "@b45acf5",
    "tree": "",
}


def source_dir(spec: str, work: Path, name: str) -> tuple[Path, list[str]]:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    if spec.startswith("@"):
        rev, flags = spec[1:].split()[0], spec.split()[1:]
        for f in FILES:
            text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{f}"], cwd=ROOT, capture_output=True, text=True)
            if text.returncode == 0:
                (d / f).write_text(text.stdout)
        return d, flags
    for f in FILES:
        shutil.copy(ROOT / CSRC / f, d / f)
    return d, spec.split()


def load_ext(d: Path, name: str, flags: list[str]):
    from torch.utils.cpp_extension import load

    cflags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", *flags]
    srcs = [str(d / "binding.cpp"), str(d / "decode_sm90.cu")]
    return load(name=f"qv_{name}", sources=srcs, extra_include_paths=[str(d)], extra_cuda_cflags=cflags)


def seeded_row(h: int, B: int, scheme: str, ctx: int):
    from decode_attention import random_store

    g = torch.Generator(device="cuda").manual_seed(0)
    store, bt, n = random_store(scheme, B, ctx, g)
    q = torch.randn(B, h, 512, device="cuda", generator=g).bfloat16()
    qr = torch.randn(B, h, 64, device="cuda", generator=g).bfloat16()
    return store, bt, n, q, qr, g


def run_one(args) -> None:
    """One variant (or FlashMLA) in this process: RESULT lines on stdout, outputs under --work."""
    from decode_attention import bench, flashmla_row, graph_of

    import quantmla.kernels.hopper.launch as launch
    from quantmla.kernels.decode import mla_decode

    work, name = Path(args.work), args.one
    if name == "flashmla":
        from flashmla_baseline import load_flashmla

        load_flashmla(args.flashmla_lib)
    else:
        ext = load_ext(work / args.src, name, json.loads(args.flags))
        launch.extension = lambda: ext
    scale = 1 / math.sqrt(192)
    for row in args.rows.split(","):
        h, B, scheme = row.split(":")
        h, B = int(h), int(B)
        store, bt, n, q, qr, g = seeded_row(h, B, scheme, args.ctx)
        if name == "flashmla":
            print(f"RESULT {row} {flashmla_row(h, B, args.ctx, g, fp8=False)[0]:.1f}", flush=True)
            continue

        def call(ns=None, q=q, qr=qr, store=store, bt=bt, n=n):
            return mla_decode(q, qr, store, bt, n, scale, kernel="sm90", num_splits=ns)

        o = call()[0].float()
        ref_file = work / f"out_{args.ref}_{row.replace(':', '_')}.pt"
        if name == args.ref:
            torch.save(o.cpu(), ref_file)
        diff = float((o.cpu() - torch.load(ref_file)).abs().max()) if ref_file.exists() else float("nan")
        gr = graph_of(call)
        us = bench(gr.replay)
        del gr
        print(f"RESULT {row} {us:.1f} {diff:.2e}", flush=True)
        if args.splits and (h, B, scheme) == (128, 32, "c4r4"):
            for ns in [int(x) for x in args.splits.split(",")]:
                gr = graph_of(lambda ns=ns: call(ns))
                print(f"  {name} {row} splits={ns}: {bench(gr.replay):.1f} us", flush=True)
                del gr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flashmla-lib", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--extra", action="append", default=[], help="name=flags (another variant)")
    ap.add_argument("--rows", default="128:32:c4r4,128:32:c2r4,128:8:c4r4,64:32:c4r4")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--splits", default="", help="split counts to probe (h=128 B=32 c4r4)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--flags", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return run_one(args)
    specs = {n: VARIANTS[n] for n in args.variants.split(",") if n}
    for e in args.extra:
        n, f = e.split("=", 1)
        specs[n] = f
    work = Path(tempfile.mkdtemp(prefix="qv_"))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(work / "ext")
    dirs = {n: source_dir(s, work, n) for n, s in specs.items()}
    t0 = time.time()
    me = [sys.executable, str(Path(__file__).resolve())]

    def build(n):
        code = "import sys, json; sys.path.insert(0, sys.argv[1]); from variants import load_ext; "
        code += "from pathlib import Path; load_ext(Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))"
        d, flags = dirs[n]
        cmd = [sys.executable, "-c", code, str(Path(__file__).parent), str(d), n, json.dumps(flags)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return n, r.returncode, r.stderr[-1500:]

    with ThreadPoolExecutor(len(dirs)) as ex:
        for n, rc, err in ex.map(build, dirs):
            print(f"build {n}: rc={rc}" + ("" if rc == 0 else f"\n{err}"), flush=True)
    print(f"builds: {time.time() - t0:.0f} s on {torch.cuda.get_device_name()}", flush=True)
    names = list(specs)
    ref = names[0]
    times: dict[str, dict[str, str]] = {}
    common = ["--work", str(work), "--rows", args.rows, "--ctx", str(args.ctx), "--ref", ref]
    for n in [*names, "flashmla"]:
        cmd = [*me, "--one", n, *common]
        if n == "flashmla":
            cmd += ["--flashmla-lib", args.flashmla_lib or ""]
        else:
            cmd += ["--src", n, "--flags", json.dumps(dirs[n][1])]
            if n == names[-1] and args.splits:
                cmd += ["--splits", args.splits]
        r = subprocess.run(cmd, capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if line.startswith("RESULT"):
                _, row, us, *rest = line.split()
                times.setdefault(row, {})[n] = us
                print(f"{n} {row}: {us} us" + (f" (max |diff| vs {ref} {rest[0]})" if rest else ""), flush=True)
            else:
                print(line, flush=True)
        if r.returncode != 0:
            print(f"{n}: rc={r.returncode}\n{r.stderr[-2500:]}", flush=True)
    cols = [*names, "flashmla"]
    print("| h | B | scheme | " + " | ".join(f"{c} us" for c in cols) + " |")
    print("|" + "---|" * (len(cols) + 3))
    for row, t in times.items():
        print("| " + " | ".join(row.split(":")) + " | " + " | ".join(t.get(c, "-") for c in cols) + " |")


if __name__ == "__main__":
    main()
