"""Experiment: Block-GTQ's RoPE-pair allocation on top of RAQ-MLA's formats, on the bundled model.

Captures the RoPE keys of every layer on the validation split (a BF16 latent cache keeps them as computed),
pools the block energies over layers (a scheme is one for the whole model today), allocates widths per pair
at the budget of the uniform RoPE key (``--bits`` on average, ``--lo``..``--hi`` per pair) and prints the
scheme names to compare with ``quantmla eval ppl``:

    python benchmarks/experiments/rope_allocation.py --bits 4 --lo 2 --hi 6 --page 128
"""

from __future__ import annotations

import argparse

import torch

import quantmla
from quantmla.models.adapter import get_adapter
from quantmla.models.compat import cache_kwargs
from quantmla.models.loading import builtin_text
from quantmla.quant.allocate import block_energy, greedy_allocation
from quantmla.quant.mixed import pair_channel_bits
from quantmla.quant.scheme import PathFormat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=4, help="mean width per RoPE channel")
    ap.add_argument("--lo", type=int, default=2)
    ap.add_argument("--hi", type=int, default=6)
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    model, tok = quantmla.load()
    quantmla.enable_latent_attention(model)
    ids = tok(builtin_text("validation"), return_tensors="pt").input_ids[:, : args.tokens].reshape(-1, 512)
    cache = quantmla.QuantizedLatentCache(model.config, scheme="bf16")
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(cache))
    d_r = cache.layers[0].values.shape[-1]
    pairs = get_adapter(model.config).rope_layout(model.config).cache_pairs(d_r)
    energy = sum(block_energy(layer.values, pairs) for layer in cache.layers)
    widths = greedy_allocation(energy, args.bits * d_r // 2, args.lo, args.hi)
    rope = PathFormat("int", channel_bits=pair_channel_bits(widths, pairs.tolist()), page=args.page)
    print("pair energy (pooled over layers):", [round(float(e), 3) for e in energy])
    print("widths per pair:", widths)
    print("RoPE path:", f"r{rope.spec}", f"(uniform: r{args.bits}p{args.page})")


if __name__ == "__main__":
    main()
