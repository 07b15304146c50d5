"""Experiment: Block-GTQ's RoPE-pair allocation on the bundled model, pooled over layers (a scheme is one for
the whole model today).

Scores each RoPE block per layer (``--score qk``: Block-GTQ's ``(E||q_i||^2 + E||k_i||^2) / 2`` from
:func:`quantmla.calibrate.rope_energy.rope_block_scores`; ``--score k``: the keys' energy only), normalises
each layer's scores to mean 1 and averages them over layers, allocates widths per pair at the budget of the
uniform key (``--bits`` on average, ``--lo``..``--hi`` a pair) and prints the RoPE path for TQ-MSE
(``--quantiser tq``: ``rm...t``) or for the affine per-channel pages (``--quantiser paged``: ``rm...p128``),
to compare with ``quantmla eval ppl``:

    python benchmarks/experiments/rope_allocation.py --bits 3 --lo 1 --hi 6 --quantiser tq
"""

from __future__ import annotations

import argparse

import torch

import quantmla
from quantmla.calibrate.rope_energy import rope_block_scores
from quantmla.formats.scheme import PathFormat
from quantmla.measure.tokens import token_windows
from quantmla.models.adapter import get_adapter
from quantmla.models.loading import builtin_text
from quantmla.quant.allocate import greedy_allocation
from quantmla.quant.mixed import pair_channel_bits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=3, help="mean width per RoPE channel")
    ap.add_argument("--lo", type=int, default=1)
    ap.add_argument("--hi", type=int, default=6)
    ap.add_argument("--score", choices=("qk", "k"), default="qk")
    ap.add_argument("--quantiser", choices=("tq", "paged"), default="tq")
    ap.add_argument("--windows", type=int, default=8, help="validation windows of 1,024 tokens")
    args = ap.parse_args()
    model, tok = quantmla.load(dtype=torch.float32)
    windows = token_windows(tok, builtin_text("validation"), 1024, args.windows, spread=True)
    per_layer = rope_block_scores(model, windows, keys_only=args.score == "k")
    pooled = torch.stack([s / s.mean() for s in per_layer.values()]).mean(0)
    d_r = 2 * pooled.numel()
    pairs = get_adapter(model.config).rope_layout(model.config).cache_pairs(d_r)
    widths = greedy_allocation(pooled, args.bits * d_r // 2, args.lo, args.hi)
    bits = pair_channel_bits(widths, pairs.tolist())
    if args.quantiser == "tq":
        rope = PathFormat("int", channel_bits=bits, turbo=True)
    else:
        rope = PathFormat("int", channel_bits=bits, page=128)
    print("pooled block scores:", [round(float(e), 2) for e in pooled])
    print("widths per pair:", widths)
    print(f"RoPE path: r{rope.spec} ({rope.bits_per_element(d_r, 64):.3f} BPE)")


if __name__ == "__main__":
    main()
