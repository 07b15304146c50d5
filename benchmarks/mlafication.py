"""MLAfication of the GQA teacher: conversion, distillation, then quantmla's low-bit cache.

For a Qwen3-style GQA teacher (q_norm/k_norm) and its token splits (``.u16.npy`` as the training script writes
them), measures on the test split at ``--seq`` tokens: perplexity, KL(teacher || model) per token, and NIAH
(training and held-out needle templates), for

- the teacher (its own BF16 cache);
- the DeepSeek export at each ``--sizes`` latent width (the cache as a share of the teacher's), before and after
  distillation (attention and norms trained on ``--distill-steps`` x ``--distill-batch`` x ``--distill-seq``
  tokens of the training split, KL to the teacher);
- the distilled exports with quantmla's C4R4 and C2R4 caches after QuantMLA's calibration;
- ablations at the middle size, before distillation: joint vs split latent, activation-aware vs weight-only SVD,
  contribution vs uniform RoPE pairs (in the per-KV-head form: DeepSeek's one RoPE key cannot hold per-head
  pairs), calibrated vs gain-only KNorm, and the per-KV-head form against the DeepSeek export.

Every result is appended to ``--out`` (JSON) as soon as it is measured.

    PYTHONPATH=src python benchmarks/mlafication.py --teacher DIR --tokens TOKDIR --niah-text TEXT --out OUT.json
    PYTHONPATH=src python benchmarks/mlafication.py --quick --out /tmp/mlafication-quick.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def windows_of(data: np.ndarray, seq: int, count: int) -> torch.Tensor:
    """``count`` windows of ``seq`` tokens spread evenly over ``data`` (all non-overlapping ones: ``count`` 0)."""
    n = len(data) // seq
    idx = range(n) if count == 0 or count >= n else np.linspace(0, n - 1, count).round().astype(int)
    return torch.from_numpy(np.stack([data[i * seq : (i + 1) * seq] for i in idx]).astype(np.int64))


@torch.no_grad()
def evaluate(model, teacher, windows: torch.Tensor, batch: int, scheme=None, group_size: int = 64) -> dict:
    """Perplexity and KL(teacher || model) per token over ``windows`` (``scheme``: quantmla's simulated decode
    cache; None: the model's own full-precision attention)."""
    from contextlib import nullcontext

    from quantmla.measure.simulate import simulated_decode

    device = next(model.parameters()).device
    nll, kl, count = 0.0, 0.0, 0
    for x in windows.split(batch):
        x = x.to(device)
        t = torch.log_softmax(teacher(x, use_cache=False).logits[:, :-1].float(), -1)
        ctx = simulated_decode(model, scheme, group_size) if scheme is not None else nullcontext()
        with ctx:
            s = torch.log_softmax(model(x, use_cache=False).logits[:, :-1].float(), -1)
        nll -= s.gather(-1, x[:, 1:, None]).sum().item()
        kl += (t.exp() * (t - s)).sum().item()
        count += x[:, 1:].numel()
    return {"ppl": math.exp(nll / count), "kl": kl / count, "tokens": count}


def niah(model, tok, text: str, templates: str, n: int, scheme=None) -> dict:
    """NIAH accuracy (niah-1/2/3 x 1K/2K/4K x five depths, ``n`` a cell): through the model's own transformers
    cache (``scheme`` None) or quantmla's cache."""
    if scheme is None:
        from train_tiny_mla import niah_own_cache

        hits = niah_own_cache(model, tok, text, n, templates)
        return {k: v["correct"] / v["answers"] for k, v in hits.items() if k in ("all", "1024", "2048", "4096")}
    from quantmla.eval.niah import NiahConfig, accuracy, run_niah

    rows = run_niah(model, tok, text, [scheme], NiahConfig(num_examples=n, templates=templates), progress=False)
    out = {"all": accuracy(rows)}
    for length in (1024, 2048, 4096):
        out[str(length)] = accuracy(rows, length=length)
    return out


def quick_setup(tmp: Path):
    """A tiny random Qwen3 teacher and random token splits (the CPU smoke run)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from quantmla.models.loading import load_tokenizer

    tok = load_tokenizer("builtin:tiny-mla")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=True)  # fmt: skip
    teacher_dir = tmp / "teacher"
    Qwen3ForCausalLM(cfg).save_pretrained(teacher_dir)
    tok.save_pretrained(teacher_dir)
    rng = np.random.default_rng(0)
    splits = {s: rng.integers(0, len(tok), 200_000).astype(np.uint16) for s in ("train", "validation", "test")}
    return teacher_dir, splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", type=Path)
    ap.add_argument("--tokens", type=Path, help="train/validation/test .u16.npy")
    ap.add_argument("--niah-text", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--save-dir", type=Path, default=None, help="write the distilled exports here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--eval-windows", type=int, default=256, help="test windows spread over the split (0: all)")
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--rope-pairs", type=int, default=4)
    ap.add_argument("--sizes", default="72,40,24", help="latent widths")
    ap.add_argument("--calib-seqs", type=int, default=16)
    ap.add_argument("--calib-seq", type=int, default=2048)
    ap.add_argument("--distill-steps", type=int, default=300)
    ap.add_argument("--distill-batch", type=int, default=4)
    ap.add_argument("--distill-seq", type=int, default=2048)
    ap.add_argument("--distill-lr", type=float, default=1e-3)
    ap.add_argument("--cal-steps", type=int, default=100, help="QuantMLA layer-stage steps a path")
    ap.add_argument("--cal-model-steps", type=int, default=50)
    ap.add_argument("--schemes", default="c4,c2", help="content bits of the quantised rows (RoPE at 4 bits)")
    ap.add_argument("--niah-n", type=int, default=2)
    ap.add_argument("--niah-templates", default="train,heldout")
    ap.add_argument("--skip-ablations", action="store_true")
    ap.add_argument("--skip-teacher-niah", action="store_true", help="the teacher's NIAH is known from an earlier run")
    ap.add_argument("--quick", action="store_true", help="tiny random teacher and data, short everything (CPU)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.calibrate import calibrate_model
    from quantmla.convert import ConvertConfig, DistillConfig, convert, distill_conversion, save, to_deepseek
    from quantmla.convert.partial import install_latent

    if args.quick:
        import tempfile

        tmp = Path(tempfile.mkdtemp())
        args.teacher, splits = quick_setup(tmp)
        args.seq, args.eval_windows, args.eval_batch, args.calib_seqs, args.calib_seq = 256, 4, 2, 4, 128
        args.distill_steps, args.distill_batch, args.distill_seq, args.sizes = 3, 2, 128, "24,12"
        args.cal_steps, args.cal_model_steps, args.niah_n = 2, 1, 1
    else:
        splits = {s: np.load(args.tokens / f"{s}.u16.npy", mmap_mode="r") for s in ("train", "validation", "test")}
    dev = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.teacher)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).to(dev).eval()
    text = args.niah_text.read_text() if args.niah_text is not None else None
    test = windows_of(splits["test"], args.seq, args.eval_windows)
    calib = windows_of(splits["validation"], args.calib_seq, args.calib_seqs)
    train = splits["train"]
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    norm = ConvertConfig(rope_pairs=1, latent_rank=1).latent_norm
    result = {"command": " ".join(sys.argv), "latent_norm": norm, "date": str(date.today()), "card": card,
              "torch": torch.__version__,
              "dtype": "float32 (the teacher's BF16 weights)", "eval": {"windows": len(test), "seq": args.seq},
              "rows": []}  # fmt: skip
    n_kv, d_h = teacher.config.num_key_value_heads, teacher.config.head_dim
    source_elems = 2 * n_kv * d_h

    def record(name: str, **fields) -> None:
        row = {"name": name, **fields}
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(row), flush=True)

    def niah_all(model, scheme=None) -> dict:
        if text is None:
            return {}
        return {t: niah(model, tok, text, t, args.niah_n, scheme) for t in args.niah_templates.split(",")}

    t0 = time.time()
    record("teacher (GQA, BF16 cache)", cache_share=1.0, **evaluate(teacher, teacher, test, args.eval_batch),
           niah={} if args.skip_teacher_niah else niah_all(teacher), seconds=round(time.time() - t0, 1))  # fmt: skip
    sizes = [int(s) for s in args.sizes.split(",")]
    r = args.rope_pairs

    def cfg_for(rank, **kw):
        return ConvertConfig(rope_pairs=r, latent_rank=rank, num_seqs=args.calib_seqs, seq_len=args.calib_seq, **kw)

    def share(rank):
        return (rank + 2 * r) / source_elems

    def batches():
        gen = np.random.default_rng(0)
        while True:
            starts = gen.integers(0, len(train) - args.distill_seq, size=args.distill_batch)
            yield torch.from_numpy(np.stack([train[s : s + args.distill_seq] for s in starts]).astype(np.int64))

    if not args.skip_ablations:
        mid = sizes[len(sizes) // 2]
        for label, kw, per_head in [
            ("uniform, joint, activation-aware, calibrated KNorm", {}, False),
            ("per-KV-head form of the same (no shared RoPE key, per-head q_norm)", {}, True),
            ("split latent", {"latent": "split"}, False),
            ("weight-only SVD", {"svd": "weight"}, False),
            ("functional SVD (score and output error)", {"svd": "functional"}, False),
            ("gain-only KNorm", {"knorm": "gain-only"}, False),
            ("latent RMSNorm kept (gain: the latent's mean RMS)", {"latent_norm": "rms"}, False),
            ("contribution pairs (per-KV-head form)", {"rope": "contribution"}, True),
        ]:
            t0 = time.time()
            conv = convert(teacher, cfg_for(mid, **kw), calib, progress=False, export=not per_head)
            if per_head:
                model = copy.deepcopy(teacher)
                install_latent(model, conv.shape, conv.layers, conv.latent_norm_gains())
            else:
                model = to_deepseek(teacher, conv, torch.float32).to(dev).eval()
            record(f"ablation at latent {mid}: {label}", cache_share=share(mid), latent=mid, rope_pairs=r,
                   **evaluate(model, teacher, test, args.eval_batch), seconds=round(time.time() - t0, 1))  # fmt: skip
            del model

    for rank in sizes:
        t0 = time.time()
        conv = convert(teacher, cfg_for(rank), calib, progress=False)
        student = to_deepseek(teacher, conv, torch.float32).to(dev).eval()
        record(f"MLA latent {rank} + RoPE {2 * r}, converted", cache_share=share(rank), latent=rank, rope_pairs=r,
               **evaluate(student, teacher, test, args.eval_batch), seconds=round(time.time() - t0, 1))  # fmt: skip
        t0 = time.time()
        dcfg = DistillConfig(steps=args.distill_steps, lr=args.distill_lr, warmup=max(1, args.distill_steps // 20))
        curve = distill_conversion(student, teacher, conv, batches(), dcfg, progress=False)
        took = round(time.time() - t0, 1)
        tokens = args.distill_steps * args.distill_batch * args.distill_seq
        record(f"MLA latent {rank} + RoPE {2 * r}, distilled", cache_share=share(rank), latent=rank, rope_pairs=r,
               **evaluate(student, teacher, test, args.eval_batch), niah=niah_all(student), distill_seconds=took,
               distill_tokens=tokens, curve=curve)  # fmt: skip
        if args.save_dir is not None:
            save(copy.deepcopy(student).to(torch.bfloat16), conv, args.save_dir / f"mla-{rank}", tok)
        for bits in args.schemes.split(","):
            gc = 64 if rank % 64 == 0 else rank
            scheme = f"{bits}g{gc}r4g{2 * r}"
            t0 = time.time()
            q = copy.deepcopy(student)
            calib_text = windows_of(splits["validation"], 512, 48)
            q, report = calibrate_model(q, tok, calib_text, scheme=scheme, method="quantmla", steps=args.cal_steps,
                                        model_steps=args.cal_model_steps, num_seqs=32, val_seqs=16, seq_len=512,
                                        progress=False)  # fmt: skip
            from quantmla.formats.scheme import parse_scheme

            stored = parse_scheme(scheme).bytes_per_token(rank, 2 * r)  # windows' BF16 tokens not counted
            record(f"MLA latent {rank} + RoPE {2 * r}, distilled, {scheme} (QuantMLA)", scheme=scheme, latent=rank,
                   cache_share=stored / (2 * source_elems), bytes_per_token_layer=stored,
                   cal_seconds=round(time.time() - t0, 1),
                   **evaluate(q, teacher, test, args.eval_batch, scheme=scheme),
                   niah={"heldout": niah(q, tok, text, "heldout", args.niah_n, scheme)} if text else {})  # fmt: skip
            del q
        del student
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
