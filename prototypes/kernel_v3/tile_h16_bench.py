"""Experiment (issue 19): the decode kernel v3's h = 16 inner loop prototypes on the H200, side by side, timed
beside the bandwidth the cache allows: B x L tokens of an INT4 content latent (512 channels, groups of 64)
through both wgmma products with folded scales. ``tile`` (``prototypes/kernel_v3/hopper/tile_h16.cu``) loads each step
synchronously; ``stream`` (``stream_h16.cu``) copies steps ahead with cp.async, with the scores written out
(``stream+scores``) or not; ``stream-v1`` stores ``s o P`` by ``stmatrix`` and takes the magic number's 1024
off on the tensor cores; ``stream-v2`` dequantises the operands in registers (no fold); ``stream-v3``
(``stream_h16_cs.cu``) splits the channels across the warps on ``mma.sync``, each code unpacked once and
transposed in registers for the output: 4 warps a CTA (128 channels a warp), ``stream-v3w8`` 8 (64 channels a warp,
half the registers, twice the warps an SM); ``stream-v4`` is variant 3 with the output product on wgmma;
``stream-v5`` variant 3 skewed by one step (each step's output beside the next step's scores, two barriers a step),
``stream-v5s`` and ``stream-v3s`` those with the scores' mma chain split in two. The prototypes also read P (32 B
a token) and may write the scores (64 B a token), which the real kernel keeps on chip, so two bandwidths are
printed: the cache's bytes alone and everything moved.

    PYTHONPATH=src:prototypes python prototypes/kernel_v3/tile_h16_bench.py --tokens 2097152 \\
        --per-cta 4096 8000 8192 16384

The time is the extension's call alone (its output allocations included, not the sum over CTAs).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32 * 65536, help="B x L (default: B = 32, L = 64K)")
    ap.add_argument("--per-cta", type=int, nargs="+", default=[4096, 8000, 8192, 16384])
    ap.add_argument("--kernels", nargs="+", default=None, help="which of them (default: all)")
    args = ap.parse_args()
    from triton.testing import do_bench

    from kernel_v3.fragment import group_major
    from kernel_v3.hopper.build import extension
    from kernel_v3.hopper.tile import LBO, SBO

    dev = torch.device("cuda")
    t = args.tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (t // 16, 32, 32), device=dev, dtype=torch.int32, generator=gen)
    scale = (torch.rand(t, 8, device=dev, generator=gen) * 0.1 + 1e-3).half()
    minimum = torch.randn(t, 8, device=dev, generator=gen).half()
    q = torch.randn(16, 512, device=dev, generator=gen).half()
    p = (torch.rand(16, t, device=dev, generator=gen) / t).half()
    p_t = p.T.contiguous()
    scale_gm, minimum_gm = group_major(scale), group_major(minimum)  # variant 2's layout
    cache_bytes = t * (256 + 8 * 4)  # codes + fp16 scale and minimum per group
    ext, stream = extension("v3"), torch.cuda.current_stream(dev).cuda_stream
    kernels = {  # name -> (the extension's call alone, bytes moved besides the cache: P read, scores written)
        "tile": (lambda per: ext.tile_h16(words, scale, minimum, q, p, per, LBO, SBO, stream), t * (16 * 2 + 16 * 4)),
        "stream+scores": (
            lambda per: ext.stream_h16(words, scale, minimum, q, p_t, per, True, 0, LBO, SBO, stream),
            t * (16 * 2 + 16 * 4),
        ),
        "stream": (
            lambda per: ext.stream_h16(words, scale, minimum, q, p_t, per, False, 0, LBO, SBO, stream),
            t * 16 * 2,
        ),
        "stream-v1": (
            lambda per: ext.stream_h16(words, scale, minimum, q, p_t, per, False, 1, LBO, SBO, stream),
            t * 16 * 2,
        ),
        "stream-v2": (
            lambda per: ext.stream_h16_dq(words, scale_gm, minimum_gm, q, p_t, per, False, LBO, SBO, stream),
            t * 16 * 2,
        ),
        "stream-v3": (
            lambda per: ext.stream_h16_cs(words, scale_gm, minimum_gm, q, p_t, per, False, 4, 0, stream),
            t * 16 * 2,
        ),
        "stream-v3s": (
            lambda per: ext.stream_h16_cs(words, scale_gm, minimum_gm, q, p_t, per, False, 4, 4, stream),
            t * 16 * 2,
        ),
        "stream-v3w8": (
            lambda per: ext.stream_h16_cs(words, scale_gm, minimum_gm, q, p_t, per, False, 8, 0, stream),
            t * 16 * 2,
        ),
        "stream-v4": (
            lambda per: ext.stream_h16_cs(words, scale_gm, minimum_gm, q, p_t, per, False, 4, 1, stream),
            t * 16 * 2,
        ),
        "stream-v5": (
            lambda per: ext.stream_h16_cs(words, scale_gm, minimum_gm, q, p_t, per, False, 4, 2, stream),
            t * 16 * 2,
        ),
        "stream-v5s": (
            lambda per: ext.stream_h16_cs(words, scale_gm, minimum_gm, q, p_t, per, False, 4, 3, stream),
            t * 16 * 2,
        ),
    }
    for per in args.per_cta:
        for name, (call, extra) in kernels.items():
            if args.kernels and name not in args.kernels:
                continue
            ms = do_bench(lambda call=call, per=per: call(per), warmup=25, rep=200)
            row = {"kernel": name, "tokens": t, "per_cta": per, "ctas": -(-t // per), "us": ms * 1e3,
                   "cache_TBps": cache_bytes / ms / 1e9, "all_TBps": (cache_bytes + extra) / ms / 1e9}  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
