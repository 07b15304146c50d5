"""MLAfication before distillation, on the CPU: what each approximation costs the GQA teacher.

KL(teacher || model) per token and perplexity on 12 test windows of 1,024 tokens (spread over the split), the
statistics from 16 validation windows of 2,048 tokens:

- the converted layers in the source model (per-KV-head RoPE) with the latent norm left out or a kept RMSNorm, for
  the activation-aware, functional and weight-only SVD (4 RoPE pairs, latent 40);
- every pair kept at full rank (only k_norm replaced by its calibrated constant);
- the DeepSeek export at one cache budget (48 elements a token) split three ways between RoPE pairs and latent.

    PYTHONPATH=src python benchmarks/experiments/mlafication_cpu.py --teacher DIR --tokens TOKDIR
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlafication import evaluate, windows_of  # noqa: E402


def teacher_and_splits(description: str):
    """``(teacher, validation, test)`` from ``--teacher DIR --tokens TOKDIR`` (float32 teacher, memory-mapped
    token splits)."""
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, required=True, help="validation/test .u16.npy")
    args = ap.parse_args()
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    val = np.load(args.tokens / "validation.u16.npy", mmap_mode="r")
    return teacher, val, np.load(args.tokens / "test.u16.npy", mmap_mode="r")


def main() -> None:
    teacher, val, test = teacher_and_splits(__doc__.split("\n\n")[0])
    from quantmla.convert import ConvertConfig, convert, to_deepseek
    from quantmla.convert.deepseek import latent_rms
    from quantmla.convert.partial import install_latent

    calib, ev = windows_of(val, 2048, 16), windows_of(test, 1024, 12)

    def cfg(r, rank, **kw):
        return ConvertConfig(rope_pairs=r, latent_rank=rank, num_seqs=16, seq_len=2048, **kw)

    def report(label, model):
        with torch.no_grad():
            res = evaluate(model, teacher, ev, 4)
        print(f"| {label} | {res['ppl']:.2f} | {res['kl']:.4f} |", flush=True)

    print("| model | ppl | KL |\n|---|---|---|")
    for r, rank in ((4, 40), (32, 128)):
        for svd in ("activation", "functional", "weight") if r == 4 else ("activation", "weight"):
            conv = convert(teacher, cfg(r, rank, svd=svd), calib, progress=False, export=False)
            for norm in (False, True):
                if r == 32 and norm:
                    continue
                gains = [latent_rms(la, st) for la, st in zip(conv.layers, conv.stats, strict=True)] if norm else None
                model = copy.deepcopy(teacher)
                install_latent(model, conv.shape, conv.layers, gains)
                what = "every pair, full rank" if r == 32 else f"{r} pairs, latent {rank}"
                report(f"per-KV-head form, {what}, {svd} SVD, latent norm {'RMSNorm' if norm else 'none'}", model)
    for r, rank, svd in ((4, 40, "activation"), (4, 40, "functional"), (8, 32, "activation"), (16, 16, "activation")):
        conv = convert(teacher, cfg(r, rank, svd=svd), calib, progress=False)
        model = to_deepseek(teacher, conv, torch.float32)
        report(f"DeepSeek export, {r} pairs + latent {rank} (48 elements), {svd} SVD", model)


if __name__ == "__main__":
    main()
