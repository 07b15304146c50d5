"""Time the library's low-bit decode kernel as it is at two (or more) git revisions, side by side.

Each revision's ``src/quantmla/kernels/unpack.py`` and ``decode_lowbit.py`` are read with ``git show``
into a temporary module pair, so the kernels run in one process on the same caches (timings on a
shared GPU are only comparable within one run). The caches are built by the working tree's
``layout.py``: the revisions compared must share the packing. Every revision is first checked against
the first one (relative error of the output and of the LSE below 1e-3), then each is timed three times,
interleaved; the table gives the median of the three do_bench medians (L2 flushed).

    PYTHONPATH=src:benchmarks python benchmarks/compare_lowbit.py 89769f3 .      # ".": the working tree
    PYTHONPATH=src:benchmarks python benchmarks/compare_lowbit.py 89769f3 . --cases 16:8:65536:c4r4
    PYTHONPATH=src:benchmarks python benchmarks/compare_lowbit.py old_decode_lowbit.py .   # a saved copy

(On the lent GPU the checkout's git history is the one of the session's start, so name the working
tree ``.`` rather than ``HEAD``; a revision made since then can be passed as a saved copy of its
``decode_lowbit.py``, a path ending in ``.py``, run with the working tree's ``unpack.py``.)

GPU only. Launch: 4 warps, 8 programs per SM, the library's pipeline stages and register cap for the
scheme at h <= 16 (``default_launch``) unless ``--stages`` / ``--maxnreg`` are given (``--maxnreg 0``:
no cap).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def load_revision(rev: str, tmp: Path, i: int):
    """The ``_lowbit_kernel`` of revision ``rev`` (``.``: the working tree; a path ending in ``.py``: that
    file with the working tree's unpack module), with its own unpack module, as module ``lowbit_<i>``."""
    files = {}
    for name in ("unpack", "decode_lowbit"):
        path = f"src/quantmla/kernels/{name}.py"
        if rev == "." or (name == "unpack" and rev.endswith(".py")):
            src = Path(path).read_text()
        elif rev.endswith(".py"):
            src = Path(rev).read_text()
        else:
            src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        files[name] = src.replace("from quantmla.kernels.unpack import", f"from unpack_{i} import")
    (tmp / f"unpack_{i}.py").write_text(files["unpack"])
    (tmp / f"lowbit_{i}.py").write_text(files["decode_lowbit"])
    spec = importlib.util.spec_from_file_location(f"lowbit_{i}", tmp / f"lowbit_{i}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._lowbit_kernel


def main() -> None:
    from decode_attention import bench, random_store, splits_for
    from decode_variants import launch

    from quantmla.kernels.decode import default_launch

    ap = argparse.ArgumentParser()
    ap.add_argument("revs", nargs="+", help="git revisions or . for the working tree (the first is the reference)")
    ap.add_argument("--cases", default="16:32:65536:c4r4,16:32:65536:c2r4", help="h:B:L:scheme, comma-separated")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap; default: the library's for the scheme")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages; default: the library's for the scheme")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compare_lowbit.py times GPU kernels: no CUDA device")
    with tempfile.TemporaryDirectory() as d:
        sys.path.insert(0, d)
        kernels = {rev: load_revision(rev, Path(d), i) for i, rev in enumerate(args.revs)}
        gen = torch.Generator(device="cuda").manual_seed(0)
        scale = 1 / math.sqrt(192)
        print("| h | B | L | scheme | revision | median us | rounds |\n|---|---|---|---|---|---|---|")
        for case in args.cases.split(","):
            h, B, L, scheme = case.split(":")
            h, B, L = int(h), int(B), int(L)
            if h > 16:
                raise SystemExit(f"h={h}: the comparison launches 16 heads per program (h <= 16)")
            store, bt, n_paged = random_store(scheme, B, L, gen)
            q = torch.randn(B, h, 512, device="cuda", generator=gen).bfloat16()
            qr = torch.randn(B, h, 64, device="cuda", generator=gen).bfloat16()
            ns = splits_for(8, B, h, bt.shape[1])
            lau = default_launch(16, store.layout.content_bits)
            cap = lau["maxnreg"] if args.maxnreg is None else args.maxnreg
            stages = lau["num_stages"] if args.stages is None else args.stages
            fns, ref = {}, None
            for rev, kern in kernels.items():
                a = (kern, q, qr, store, store.content, bt, n_paged, scale, ns, 4, stages, cap or None)
                o, lse = launch(*a)
                if ref is None:
                    ref = (o.float(), lse)
                err = float((o.float() - ref[0]).norm() / ref[0].norm())
                if err > 1e-3 or float((lse - ref[1]).abs().max()) > 1e-3:
                    raise RuntimeError(f"{rev} disagrees with {args.revs[0]}: relative error {err:.3g}")
                fns[rev] = lambda a=a: launch(*a)
            times = {rev: [] for rev in fns}
            for _ in range(3):
                for rev, f in fns.items():
                    times[rev].append(bench(f))
            for rev, v in times.items():
                rounds = " / ".join(f"{x:.1f}" for x in v)
                print(f"| {h} | {B} | {L} | {scheme} | {rev} | {statistics.median(v):.1f} | {rounds} |", flush=True)
            del store
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
