"""Experiment: RAQ-MLA's latent with its bits allocated across layers, against RAQ-MLA's uniform latent at the
same mean bits, on CPU with a reduced recipe.

Per layer, RAQ-MLA's latent transform is fitted at each width of a menu (e.g. INT2 and INT3 in clipped groups of
128); each layer's model-level sensitivity is the held-out KL (validation text, 4K windows) when that layer alone
is raised one width; widths are then raised greedily by KL gained per byte (`quantmla.calibrate.layer_alloc.greedy`)
within the budget's bytes, or as `--choice` gives them. The RoPE key stays the budget's format, untransformed, in
every row (the latent's allocation alone). The method that does this with RAQ-MLA's full fit is `--method raq-alloc`.

    python benchmarks/experiments/layer_allocation.py --budget c2q94r4p64 --menu c2g128q94,c3g128q94
    python benchmarks/experiments/layer_allocation.py --choice 0,0,0,0,0,0,1,0   # one layer raised (2.8 BPE)
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import time
from pathlib import Path

import torch

import quantmla
from quantmla.calibrate import calibrate_model
from quantmla.calibrate.layer_alloc import greedy
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.eval.ppl import paired_bootstrap
from quantmla.formats.codec import LayerCodec, ModelCodec
from quantmla.formats.scheme import parse_scheme
from quantmla.models.loading import builtin_text

RECIPE = dict(num_seqs=32, val_seqs=8, seq_len=512, progress=False, paths=("content",), method="raq")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="c2q94r4p64", help="the uniform scheme whose BPE is the budget")
    ap.add_argument("--menu", default="c2g128q94,c3g128q94", help="latent formats a layer may take, narrowest first")
    ap.add_argument("--sens-seqs", type=int, default=2, help="validation windows of 4,096 for the sensitivities")
    ap.add_argument("--json", default=None)
    ap.add_argument("--codecs", default=None, help="folder where the fitted codecs are saved and reused")
    ap.add_argument("--choice", default=None, help="evaluate this menu index per layer (e.g. 0,0,0,0,0,0,1,0)")
    args = ap.parse_args()
    torch.manual_seed(0)
    base, tok = quantmla.load(dtype=torch.float32)
    quantmla.enable_latent_attention(base)
    calib, test = builtin_text("validation"), builtin_text("test")
    budget = parse_scheme(args.budget)
    rope = budget.rope.spec
    menu = [f"{m}r{rope}" for m in args.menu.split(",")]
    codecs, secs = {}, {}
    for s in dict.fromkeys([args.budget, *menu]):
        saved = Path(args.codecs) / f"{s}.pt" if args.codecs else None
        if saved is not None and saved.exists():
            codecs[s] = torch.load(saved, weights_only=False)
            continue
        t0 = time.perf_counter()
        _, rep = calibrate_model(copy.deepcopy(base), tok, calib, scheme=s, **RECIPE)
        codecs[s], secs[s] = rep.codec, time.perf_counter() - t0
        print(f"fitted {s} in {secs[s]:.0f} s", flush=True)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rep.codec, saved)
    n = len(codecs[menu[0]].layers)

    def mixed(choice: list[int]) -> ModelCodec:
        layers = tuple(LayerCodec(codecs[menu[c]].layers[i].content, codecs[menu[c]].layers[i].rope)
                       for i, c in enumerate(choice))  # fmt: skip
        return ModelCodec("raq alloc " + "/".join(str(c) for c in choice), layers)

    def kl(codec, text, num) -> float:
        cfg = PerplexityConfig(scheme=codec, seq_len=4096, num_seqs=num, spread=True, kl=True, batch_size=1)
        return perplexity(base, tok, text, cfg, progress=False).kl

    dims = (base.config.kv_lora_rank, base.config.qk_rope_head_dim)
    target = codecs[args.budget].bytes_per_token(*dims) * n
    sens_file = Path(args.codecs) / f"sens-{'+'.join(menu)}-{args.sens_seqs}.json" if args.codecs else None
    sens = json.loads(sens_file.read_text()) if sens_file is not None and sens_file.exists() else {}
    if "start" not in sens:
        sens["start"] = kl(mixed([0] * n), calib, args.sens_seqs)
    print(f"all {menu[0]}: held-out KL {sens['start']:.4e}", flush=True)
    for i, j in itertools.product(range(n), range(1, len(menu))):
        if f"{i}:{j}" not in sens:
            sens[f"{i}:{j}"] = kl(mixed([j if k == i else 0 for k in range(n)]), calib, args.sens_seqs)
        print(f"  layer {i} -> {menu[j]}: KL {sens[f'{i}:{j}']:.4e}", flush=True)
    if sens_file is not None:
        sens_file.write_text(json.dumps(sens))
    if args.choice:
        choice = [int(c) for c in args.choice.split(",")]
    else:
        costs = [[codecs[m].layers[i].scheme.bytes_per_token(*dims) for m in menu] for i in range(n)]
        gains = [[0.0] + [sens["start"] - sens[f"{i}:{j}"] for j in range(1, len(menu))] for i in range(n)]
        choice = greedy(costs, gains, target)
    print(f"choice {choice}", flush=True)
    alloc = mixed(choice)
    rows = {}
    for name, codec in (("uniform " + args.budget, codecs[args.budget]), ("uniform " + menu[0], codecs[menu[0]]),
                        ("allocated", alloc)):  # fmt: skip
        cfg = PerplexityConfig(scheme=codec, seq_len=4096, num_seqs=6, spread=True, kl=True, per_window=True,
                               batch_size=2)  # fmt: skip
        r = perplexity(base, tok, test, cfg, progress=False)
        rows[name] = {"ppl": r.ppl, "kl": r.kl, "bpe": codec.bits_per_element(*dims), "window_nll": r.window_nll,
                      "tokens": r.tokens // r.sequences}  # fmt: skip
        print(json.dumps({"row": name, "ppl": r.ppl, "kl": r.kl, "bpe": rows[name]["bpe"]}), flush=True)
    ref = rows["uniform " + args.budget]
    for name, r in rows.items():
        lo, hi = paired_bootstrap(ref["window_nll"], r["window_nll"], r["tokens"])
        print(f"| {name} | {r['bpe']:.3f} | {r['ppl']:.4f} | {r['kl']:.3e} | "
              f"{100 * (r['ppl'] / ref['ppl'] - 1):+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}] |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"choice": choice, "menu": menu, "sens": sens, "rows": rows, "fit_s": secs}, f, indent=1)


if __name__ == "__main__":
    main()
