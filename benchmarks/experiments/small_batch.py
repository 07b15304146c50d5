"""Small-batch decode on the GPU: the combine pass's launch shape and the number of KV splits.

    PYTHONPATH=src:benchmarks python benchmarks/experiments/small_batch.py combine   # combine pass, standalone
    PYTHONPATH=src:benchmarks python benchmarks/experiments/small_batch.py splits    # programs per SM, graph times

``combine`` times the library's ``_combine_kernel`` on random split partials for several (channels per
program, splits per step, warps); ``512, 8, 4`` is the launch before 2026-11-30 (one program per
sequence and head). ``splits`` times ``mla_decode`` replayed from a CUDA graph (the GPU time, without the
Python launch cost) at 1, 2, 4, 8 and 16 programs per SM. BENCHMARKS.md ("Small batches") has the
tables; they were measured with the scratch form of this script, whose ``old`` combine column was the
previous kernel itself (43.5 us at B=8, h=16, 132 splits, against 41.9 for ``512, 8, 4`` here).
"""

from __future__ import annotations

import argparse
import math

import torch

COMBINE_SHAPES = [(8, 16, 132), (32, 16, 33), (1, 16, 64), (128, 16, 9), (8, 128, 66), (32, 128, 17)]
COMBINE_LAUNCHES = [(512, 8, 4), (64, 8, 1), (64, 16, 1), (64, 4, 1), (32, 8, 1), (128, 8, 2), (128, 16, 2)]
SPLIT_SHAPES = [
    (16, 1, 4096), (16, 1, 65536), (16, 8, 4096), (16, 8, 16384), (16, 8, 65536), (16, 32, 4096), (16, 32, 16384),
    (16, 32, 65536), (16, 128, 4096), (128, 8, 16384), (128, 8, 65536), (128, 32, 4096), (128, 32, 16384),
]  # fmt: skip


def combine_table() -> None:
    from decode_attention import bench

    from quantmla.kernels.decode import _combine_kernel

    heads = [f"{d} ch., {c} splits/step, {w} warps" for d, c, w in COMBINE_LAUNCHES]
    print("| B, h, splits | " + " | ".join(heads) + " |")
    print("|---" * (len(COMBINE_LAUNCHES) + 1) + "|")
    for B, H, nsp in COMBINE_SHAPES:
        DC = 512
        op = torch.randn(B, nsp, H, DC, device="cuda")
        lp = torch.randn(B, nsp, H, device="cuda")
        outs, cells = [], []
        for bd, chunk, warps in COMBINE_LAUNCHES:
            o = torch.empty(B, H, DC, device="cuda")
            lse = torch.empty(B, H, device="cuda")

            grid = (B, H, DC // bd)
            args = (op, lp, o, lse, lp, H, nsp)  # every split read (no used counts)
            kw = dict(DC=DC, BLOCK_D=bd, CHUNK=chunk, USED=False, WIN=0, num_warps=warps)

            def f(grid=grid, args=args, kw=kw):
                _combine_kernel[grid](*args, **kw)

            f()
            outs.append((o, lse))
            cells.append(f"{bench(f):.1f}")
        for o, lse in outs[1:]:  # every launch shape gives the same merge
            torch.testing.assert_close(o, outs[0][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse, outs[0][1])
        print(f"| {B}, {H}, {nsp} | " + " | ".join(cells) + " |", flush=True)


def splits_table(schemes: list[str]) -> None:
    from decode_attention import bench, graph_of, random_store, splits_for

    from quantmla.kernels.decode import mla_decode
    from quantmla.kernels.splits import default_num_splits

    gen = torch.Generator(device="cuda").manual_seed(0)
    per_sm = (1, 2, 4, 8, 16)
    print("| h, B, L | scheme | " + " | ".join(f"{p} per SM" for p in per_sm) + " | default (splits) |")
    print("|---" * (len(per_sm) + 3) + "|")
    for h, B, L in SPLIT_SHAPES:
        for scheme in schemes:
            store, bt, n = random_store(scheme, B, L, gen)
            q = torch.randn(B, h, 512, device="cuda", generator=gen).bfloat16()
            qr = torch.randn(B, h, 64, device="cuda", generator=gen).bfloat16()
            cells = []
            for p in per_sm:
                ns = splits_for(p, B, h, bt.shape[1])
                call = (q, qr, store, bt, n, 0.07)
                g = graph_of(lambda call=call, ns=ns: mla_decode(*call, num_splits=ns))
                cells.append(f"{bench(g.replay):.1f} ({ns})")
                del g
            ns = default_num_splits(B, math.ceil(h / 64), bt.shape[1], q.device)
            print(f"| {h}, {B}, {L // 1024}K | {scheme} | " + " | ".join(cells) + f" | {ns} |", flush=True)
            del store
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table", choices=("combine", "splits"))
    ap.add_argument("--schemes", default="bf16,c4r4", help="for splits: comma-separated schemes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("small_batch.py times GPU kernels: no CUDA device")
    if args.table == "combine":
        combine_table()
    else:
        splits_table(args.schemes.split(","))


if __name__ == "__main__":
    main()
