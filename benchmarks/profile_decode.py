"""Launch one decode-kernel configuration a few times, for a profiler (ncu) to capture.

    PYTHONPATH=src:benchmarks ncu --kernel-name regex:_paged_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight python benchmarks/profile_decode.py --scheme c4r4 --heads 16
"""

from __future__ import annotations

import argparse
import math

import torch
from decode_attention import DC, DR, random_store

from quantmla.kernels.decode import mla_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="c4r4")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    store, bt, n_paged = random_store(args.scheme, args.batch, args.context, gen)
    q = torch.randn(args.batch, args.heads, DC, device="cuda", generator=gen).bfloat16()
    qr = torch.randn(args.batch, args.heads, DR, device="cuda", generator=gen).bfloat16()
    for _ in range(args.launches):
        mla_decode(q, qr, store, bt, n_paged, 1 / math.sqrt(192))
    torch.cuda.synchronize()
    k = mla_decode.last_kernel
    print(f"{args.scheme}: registers {getattr(k, 'n_regs', '?')}, spills {getattr(k, 'n_spills', '?')}")


if __name__ == "__main__":
    main()
