"""Experiment: Block-GTQ's allocation per layer vs uniform TQ-MSE on the RoPE key, bundled model v2.

A scheme is one for the whole model in `quantmla eval ppl` today, so this script runs the decode-cache
simulation with one scheme per layer (the simulation already installs one object per attention module):
content C4 (affine groups of 64) and the RoPE key in TQ-MSE, uniform (``r<b>t``) or with Block-GTQ's
per-layer allocation at the same mean width (``rm...t``, pairs scored by ``(E||q_i||^2 + E||k_i||^2) / 2``
on 8 x 1,024 validation tokens, widths 1..6), no sink/recent windows. Perplexity on the same test windows as
`quantmla eval ppl`'s default (6 x 4,096 spread over the split), with a paired bootstrap against uniform:

    python benchmarks/experiments/rope_allocation_ppl.py --bits 2,3
"""

from __future__ import annotations

import argparse
import math

import torch

import quantmla
from quantmla.calibrate.rope_energy import rope_block_scores
from quantmla.eval.ppl import paired_bootstrap
from quantmla.formats.scheme import CacheScheme, PathFormat, parse_scheme
from quantmla.measure.simulate import SimulatedDecodeCache, installed
from quantmla.measure.tokens import token_windows
from quantmla.models.adapter import get_adapter
from quantmla.models.latent import module_states
from quantmla.models.loading import builtin_text
from quantmla.quant.allocate import greedy_allocation
from quantmla.quant.mixed import pair_channel_bits


@torch.no_grad()
def window_nll(model, windows, schemes: list[CacheScheme]) -> list[float]:
    sims = [SimulatedDecodeCache(s, 64, 0, 0) for s in schemes]
    out = []
    for x in windows.split(2):
        with installed(module_states(model), sims):
            logits = model(x, use_cache=False).logits[:, :-1]
        nll = torch.logsumexp(logits, -1) - logits.gather(-1, x[:, 1:, None]).squeeze(-1)
        out += nll.double().sum(1).tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="2,3", help="mean RoPE widths to compare, comma list")
    args = ap.parse_args()
    model, tok = quantmla.load(dtype=torch.float32)
    quantmla.enable_latent_attention(model)
    scores = rope_block_scores(model, token_windows(tok, builtin_text("validation"), 1024, 8, spread=True))
    test = token_windows(tok, builtin_text("test"), 4096, 6, spread=True)
    layers = len(scores)
    pairs = get_adapter(model.config).rope_layout(model.config).cache_pairs(2 * next(iter(scores.values())).numel())
    tokens = test.shape[0] * (test.shape[1] - 1)
    print("| mean RoPE width | RoPE path | RoPE BPE | ppl | vs uniform (paired 95%) |\n|---|---|---|---|---|")
    for b in (int(v) for v in args.bits.split(",")):
        uniform = parse_scheme(f"c4r{b}t")
        base = window_nll(model, test, [uniform] * layers)
        per_layer = []
        for idx in sorted(scores):
            widths = greedy_allocation(scores[idx], b * pairs.shape[0], 1, 6)
            rope = PathFormat("int", channel_bits=pair_channel_bits(widths, pairs.tolist()), turbo=True)
            per_layer.append(CacheScheme(f"c4r{rope.spec}", uniform.content, rope))
        alloc = window_nll(model, test, per_layer)
        bpe = [s.rope.bits_per_element(2 * pairs.shape[0], 64) for s in per_layer]
        lo, hi = paired_bootstrap(base, alloc, test.shape[1] - 1)
        ppl_u, ppl_a = math.exp(sum(base) / tokens), math.exp(sum(alloc) / tokens)
        print(f"| {b} | r{b}t (uniform) | {uniform.rope.bits_per_element(64, 64):.2f} | {ppl_u:.4f} | |")
        print(f"| {b} | per-layer allocation | {min(bpe):.2f}-{max(bpe):.2f} | {ppl_a:.4f} | "
              f"{100 * (ppl_a / ppl_u - 1):+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}] |")  # fmt: skip
        for s in per_layer:
            print(f"<!-- {s.name} -->")


if __name__ == "__main__":
    main()
