"""Why the weight-only SVD starts lower than the activation-aware one (MLAfication before distillation, CPU).

On the GQA teacher, 4 RoPE pairs, the per-KV-head form, no latent norm; statistics from 16 validation windows of
2,048 tokens, KL(teacher || model) per token on test windows of 1,024 tokens:

1. each layer's held-out output error of the factorised ``[W_k,nope; W_v]`` (relative to the full-rank rows),
   keys and values apart, for the activation-aware and the weight-only SVD (the inputs of 4 test windows);
2. the KL with one layer converted and the others exact, for each layer and SVD, and at full rank (what partial
   RoPE and the calibrated KNorm cost without any factorisation);
3. the KL with every layer converted: full rank, and latent 40 for each SVD.

    PYTHONPATH=src python benchmarks/experiments/mlafication_svd_cpu.py --teacher DIR --tokens TOKDIR
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlafication import evaluate, windows_of  # noqa: E402
from mlafication_cpu import teacher_and_splits  # noqa: E402

PAIRS, RANK = 4, 40


def joint_rows(layer) -> tuple[torch.Tensor, int]:
    """``([W_k,nope; W_v] as factorised, key rows)`` of a converted layer."""
    uk = layer.up_k.reshape(-1, layer.up_k.shape[-1])
    uv = layer.up_v.reshape(-1, layer.up_v.shape[-1])
    return torch.cat([uk, uv]) @ layer.down, len(uk)


def main() -> None:
    teacher, val, test = teacher_and_splits(__doc__.split("\n\n")[0])
    from quantmla.convert import ConvertConfig, convert
    from quantmla.convert.partial import install_latent
    from quantmla.convert.source import decoder_layers

    calib, ev, ev_layer = windows_of(val, 2048, 16), windows_of(test, 1024, 12), windows_of(test, 1024, 6)
    hidden = teacher.config.hidden_size
    convs = {
        (svd, rank): convert(
            teacher,
            ConvertConfig(rope_pairs=PAIRS, latent_rank=rank, num_seqs=16, seq_len=2048, svd=svd),
            calib,
            progress=False,
            export=False,
        )  # fmt: skip
        for svd, rank in (("weight", hidden), ("weight", RANK), ("activation", RANK), ("functional", RANK))
    }
    layers = decoder_layers(teacher)
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}

    def hook(module, a, kw):
        x = kw.get("hidden_states", a[0] if a else None)
        inputs[module.layer_idx].append(x.detach().reshape(-1, x.shape[-1]).double())

    handles = [la.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for la in layers]
    with torch.no_grad():
        teacher(ev[:4], use_cache=False)
    for h in handles:
        h.remove()
    print("1. held-out output error, relative: keys / values\n")
    print("| layer | activation-aware | weight-only |\n|---|---|---|")
    for i in range(len(layers)):
        x = torch.cat(inputs[i])
        full, nk = joint_rows(convs[("weight", hidden)].layers[i])
        y = x @ full.T
        cells = []
        for svd in ("activation", "weight"):
            e = x @ joint_rows(convs[(svd, RANK)].layers[i])[0].T - y
            rel = [e[:, s].pow(2).sum() / y[:, s].pow(2).sum() for s in (slice(None, nk), slice(nk, None))]
            cells.append(f"{rel[0]:.3f} / {rel[1]:.3f}")
        print(f"| {i} | {' | '.join(cells)} |", flush=True)
    head = " | ".join(f"layer {i}" for i in range(len(layers)))
    print(f"\n2. KL with one layer converted\n\n| SVD, latent | {head} | sum |\n" + "|---" * (len(layers) + 2) + "|")
    for (svd, rank), conv in convs.items():
        whole = copy.deepcopy(teacher)
        install_latent(whole, conv.shape, conv.layers, None)
        row = []
        for i in range(len(layers)):
            model = copy.deepcopy(teacher)
            decoder_layers(model)[i].self_attn = decoder_layers(whole)[i].self_attn
            with torch.no_grad():
                row.append(evaluate(model, teacher, ev_layer, 3)["kl"])
        print(f"| {svd}, {rank} | " + " | ".join(f"{k:.3f}" for k in row) + f" | {sum(row):.3f} |", flush=True)
    print("\n3. every layer converted\n\n| SVD, latent | ppl | KL |\n|---|---|---|")
    for (svd, rank), conv in convs.items():
        model = copy.deepcopy(teacher)
        install_latent(model, conv.shape, conv.layers, None)
        with torch.no_grad():
            res = evaluate(model, teacher, ev, 4)
        print(f"| {svd}, {rank} | {res['ppl']:.2f} | {res['kl']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
