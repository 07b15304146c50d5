"""Experiment (issue 19): the decode kernel v3's h = 16 inner loop prototype (``kernels/hopper/tile_h16.cu``) on
the H200, timed beside the bandwidth the cache allows: B x L tokens of an INT4 content latent (512 channels,
groups of 64) through both wgmma products with folded scales. The prototype also reads P and writes the scores
(16 + 32 B a token that the real kernel keeps on chip), so two bandwidths are printed.

    PYTHONPATH=src python benchmarks/experiments/v3_tile_h16.py --tokens 2097152 --per-cta 4096 8192 16384
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32 * 65536, help="B x L (default: B = 32, L = 64K)")
    ap.add_argument("--per-cta", type=int, nargs="+", default=[4096, 8192, 16384])
    args = ap.parse_args()
    from triton.testing import do_bench

    from quantmla.kernels.hopper.tile import tile_h16

    dev = torch.device("cuda")
    t = args.tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (t // 16, 32, 32), device=dev, dtype=torch.int32, generator=gen)
    scale = (torch.rand(t, 8, device=dev, generator=gen) * 0.1 + 1e-3).half()
    minimum = torch.randn(t, 8, device=dev, generator=gen).half()
    q = torch.randn(16, 512, device=dev, generator=gen).half()
    p = (torch.rand(16, t, device=dev, generator=gen) / t).half()
    cache_bytes = t * (256 + 8 * 4)  # codes + fp16 scale and minimum per group
    all_bytes = cache_bytes + t * (16 * 2 + 16 * 4)  # + P read + scores written
    for per in args.per_cta:
        ms = do_bench(lambda per=per: tile_h16(words, scale, minimum, q, p, per), warmup=25, rep=200)
        row = {"tokens": t, "per_cta": per, "ctas": -(-t // per), "us": ms * 1e3,
               "cache_TBps": cache_bytes / ms / 1e9, "all_TBps": all_bytes / ms / 1e9}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
