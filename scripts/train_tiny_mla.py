"""Train the bundled ``builtin:tiny-mla`` model: a small DeepSeek-V3-class MLA language model.

    python scripts/train_tiny_mla.py --tokens .data/tokenizer-v2 --out out/tiny-mla --seq 4096 \
        --budget-minutes 7 --retrieval-share 0.2

Model v2 (issue 17): real MLA cache geometry (latent 256 = 4 groups of 64, RoPE key 64, q_lora_rank set)
scaled down to ~9.3M parameters (18.6 MB in BF16, under the 20 MB bundle limit); all MLPs dense; trained
at 4096 tokens of context. ``--retrieval-share`` of the rows are synthetic retrieval sequences
(``retrieval_mix.py``). ``--budget-minutes`` times the first steps and sets the step count (and so the
cosine schedule) to fit the budget; the count is logged. Seeded; the config hash, data hashes, loss curve and
the best checkpoint (lowest validation loss; ``--keep last``: the last) are written to ``--out``. ``--init`` starts
from trained weights of the same architecture (a fine-tuning: model v2 trained on with the template grammar,
span-copy rows and more questions a row, ``--retrieval-copy``, ``--retrieval-ask-all``).
(Model v1, latent 128 at 512 tokens, was trained by this script's version at commit 1bbc789.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from needle_grammar import parse_weights  # noqa: E402
from retrieval_mix import RetrievalMix  # noqa: E402


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> DeepseekV3Config:
    layers = 8
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=640,
        moe_intermediate_size=640,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # every MLP dense
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=128,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def gqa_config(vocab_size: int, eos_id: int, pad_id: int) -> Qwen3Config:
    """The MLAfication teacher (``--family gqa``): a Qwen3-style GQA model with per-head q_norm/k_norm, 6 query heads
    sharing 2 KV heads of 64 (RoPE over the whole head, rotate-half pairs), ~3.9M parameters (7.7 MB in BF16, under
    the 8 MB limit), the same tokenizer and context as the MLA model."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=448,
        num_hidden_layers=5,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def gqa_deep_config(vocab_size: int, eos_id: int, pad_id: int) -> Qwen3Config:
    """A deeper MLAfication teacher (``--family gqa-deep``) in the same 8 MB: 8 layers (as the MLA model, which
    retrieves) of the same attention, the MLP narrowed to 176 (~4.0M parameters, 7.9 MB in BF16). The 5-layer teacher
    found 3 of 18 needles at depth 0 and 68% held-out overall; whether depth buys retrieval here is for its GPU run."""
    config = gqa_config(vocab_size, eos_id, pad_id)
    config.num_hidden_layers, config.intermediate_size = 8, 176
    config.layer_types = ["full_attention"] * 8
    return config


FAMILIES = {"mla": model_config, "gqa": gqa_config, "gqa-deep": gqa_deep_config}


@torch.no_grad()
def niah_own_cache(model, tokenizer, text: str, n: int, templates: str) -> dict:
    """NIAH (``quantmla eval niah``'s examples: niah-1/2/3 x 1K/2K/4K x five depths, ``n`` a cell) answered greedily
    through the model's own transformers cache: the same measure for the MLA model and the GQA teacher."""
    from quantmla.eval.niah import NiahConfig, examples

    cfg = NiahConfig(num_examples=n, templates=templates)
    device = next(model.parameters()).device
    hits: dict[str, list[int]] = {}
    for ex in examples(tokenizer, text, cfg):
        ids = torch.tensor([ex.prompt_ids], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ex.value_tokens + cfg.new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        ok = ex.value in tokenizer.decode(out[0, ids.shape[1] :])
        for key in ("all", ex.task, f"{ex.length}", f"depth {ex.depth}", ex.template):
            hits.setdefault(key, [0, 0])
            hits[key][0] += int(ok)
            hits[key][1] += 1
    return {k: {"correct": c, "answers": t} for k, (c, t) in hits.items()}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def initial_model(config, init: Path | None):
    """``(model, the init files' SHA-256s)``: random weights, or ``init``'s (float32), which must be the same
    architecture exactly: every tensor by name and shape, nothing left over (else a RuntimeError naming them)."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if init is None:
        return model, None
    start = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.load_state_dict(start.state_dict(), strict=True)
    return model, {f.name: sha256_file(f) for f in sorted(Path(init).glob("*.safetensors"))}


def batches(data: np.ndarray, batch: int, seq: int, gen: np.random.Generator, mix: RetrievalMix | None,
            share: float):  # fmt: skip
    """Rows of ``seq + 1`` tokens: random crops of the train split, the first ``round(share * batch)`` of
    each batch synthetic retrieval rows."""
    n_mix = round(share * batch) if mix is not None else 0
    while True:
        starts = gen.integers(0, len(data) - seq - 1, size=batch - n_mix)
        rows = [mix.row(gen) for _ in range(n_mix)] + [data[s : s + seq + 1].astype(np.int64) for s in starts]
        yield torch.from_numpy(np.stack(rows))


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq: int, device, max_windows: int | None = 64) -> float:
    """Mean cross-entropy over the first ``max_windows`` non-overlapping windows (all of them: ``None``)."""
    model.eval()
    n = (len(data) - 1) // seq if max_windows is None else min(max_windows, (len(data) - 1) // seq)
    losses = []
    for i in range(0, n, 16):
        idx = range(i, min(n, i + 16))
        x = torch.from_numpy(np.stack([data[j * seq : j * seq + seq + 1] for j in idx]).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
    model.train()
    return float(torch.stack(losses).sum() / (n * seq))


def family_weights(text: str) -> dict[str, float]:
    """``--retrieval-families``: the grammar's parse, its error as argparse's one-line usage error."""
    try:
        return parse_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=Path, default=Path(".data/tokenizer-v2"))
    ap.add_argument("--out", type=Path, default=Path("out/tiny-mla"))
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--retrieval-share", type=float, default=0.25, help="share of each batch: retrieval rows")
    ap.add_argument("--retrieval-generated", type=float, default=0.7, help="share of needles from the grammar")
    ap.add_argument("--retrieval-same-template", type=float, default=0.3, help="share of rows of one template")
    ap.add_argument("--retrieval-pool", type=int, default=16384, help="needles (key, value, template) to draw from")
    ap.add_argument("--retrieval-ask-all", type=float, default=0.0, help="share of rows asking every needle they state")
    ap.add_argument("--retrieval-copy", type=float, default=0.0, help="share of retrieval rows that are span copies")
    ap.add_argument("--retrieval-end", type=float, default=0.0,
                    help="share of retrieval rows with one asked needle right before the questions")  # fmt: skip
    ap.add_argument("--retrieval-start", type=float, default=0.0,
                    help="share of retrieval rows with one asked needle at the haystack's start")  # fmt: skip
    ap.add_argument("--retrieval-short", type=float, default=0.0,
                    help="share of retrieval rows ending at 1K..seq tokens, plain text after")  # fmt: skip
    ap.add_argument("--retrieval-families", type=family_weights, default=None, metavar="FAMILY=W,...",
                    help="the grammar's families at these relative weights (e.g. memo=3,record=2,kv=1; "
                    "unnamed: 0); default: uniform over the six original families")  # fmt: skip
    ap.add_argument("--init", type=Path, default=None, help="start from these weights (the family's architecture)")
    ap.add_argument("--keep", choices=("best", "last"), default="best",
                    help="ship the checkpoint of lowest validation loss, or the last one (fine-tuning)")  # fmt: skip
    ap.add_argument(
        "--budget-minutes",
        type=float,
        default=0.0,
        help="time steps 5-15 and set --steps to fit this budget (0: keep --steps)",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-minutes", type=float, default=9.0, help="hard stop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="mla",
                    help="mla: builtin:tiny-mla; gqa: the teacher (gqa-deep: 8 layers)")  # fmt: skip
    ap.add_argument("--niah-text", type=Path, default=None, help="haystack: NIAH of the shipped weights at the end")
    ap.add_argument("--niah-n", type=int, default=2, help="NIAH examples a cell (with --niah-text)")
    args = ap.parse_args()
    if args.init is not None and not (args.init / "config.json").is_file():
        ap.error(f"--init {args.init}: no config.json there; give a model directory saved by this script")

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stats = json.loads((args.tokens / "tokenizer_stats.json").read_text())
    train = np.load(args.tokens / "train.u16.npy")
    val = np.load(args.tokens / "validation.u16.npy")
    config = FAMILIES[args.family](stats["vocab_size"], stats["eos_id"], stats["pad_id"])
    model, init_sha = initial_model(config, args.init)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    gen = np.random.default_rng(args.seed)
    mix = None
    if args.retrieval_share > 0:
        mix = RetrievalMix(AutoTokenizer.from_pretrained(args.tokens), train, args.seq, pool=args.retrieval_pool,
                           seed=args.seed, generated=args.retrieval_generated,
                           same_template=args.retrieval_same_template, ask_all=args.retrieval_ask_all,
                           copy_rows=args.retrieval_copy, family_weights=args.retrieval_families,
                           end_needle=args.retrieval_end, short_episodes=args.retrieval_short,
                           start_needle=args.retrieval_start)  # fmt: skip
    it = batches(train, args.batch, args.seq, gen, mix, args.retrieval_share)
    curve, best = [], (float("inf"), -1)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model.train()
    step = -1
    while step + 1 < args.steps:  # --budget-minutes may change args.steps after the first steps
        step += 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = next(it).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if args.budget_minutes > 0 and step == 4:
            torch.cuda.synchronize() if device.type == "cuda" else None
            t_timed = time.time()
        if args.budget_minutes > 0 and step == 14:
            torch.cuda.synchronize() if device.type == "cuda" else None
            per_step = (time.time() - t_timed) / 10
            # evaluation costs ~ one step per 100: keep 5% spare
            left = args.budget_minutes * 60 - (time.time() - t0)
            args.steps = max(step + 1, int(0.95 * left / per_step) + step + 1)
            print(f"timed {per_step * 1000:.0f} ms/step: {args.steps} steps fit {args.budget_minutes} min", flush=True)
        last = step == args.steps - 1 or (time.time() - t0) > args.max_minutes * 60
        if step % args.eval_every == 0 or last:
            v = evaluate(model, val, args.seq, device)
            curve.append({"step": step, "train_loss": float(loss), "val_loss": v, "seconds": time.time() - t0})
            print(
                f"step {step} train {float(loss):.3f} val {v:.3f} ppl {math.exp(v):.1f} {time.time() - t0:.0f}s",
                flush=True,
            )
            if v < best[0] or args.keep == "last":
                best = (v, step)
                model.save_pretrained(args.out / "model", max_shard_size="12MB", safe_serialization=True)
        if last:
            break
    train_seconds = time.time() - t0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (args.tokens / name).exists():
            (args.out / "model" / name).write_bytes((args.tokens / name).read_bytes())
    # ship bf16 weights (<= 25 MB); the best checkpoint was saved in fp32, convert it
    best_model = AutoModelForCausalLM.from_pretrained(args.out / "model", dtype=torch.float32)
    best_model.to(torch.bfloat16).save_pretrained(args.out / "model", max_shard_size="12MB", safe_serialization=True)
    if (args.out / "model" / "model.safetensors").exists():  # one file in BF16: the float32 shards' index is stale
        (args.out / "model" / "model.safetensors.index.json").unlink(missing_ok=True)
    # the shipped (BF16) weights on the whole validation and test splits, non-overlapping windows of --seq
    best_model = best_model.to(device)
    final = {"validation": evaluate(best_model, val, args.seq, device, max_windows=None)}
    if (args.tokens / "test.u16.npy").exists():
        final["test"] = evaluate(best_model, np.load(args.tokens / "test.u16.npy"), args.seq, device, max_windows=None)
    print("shipped weights, whole splits: " + ", ".join(f"{k} ppl {math.exp(v):.2f}" for k, v in final.items()))
    niah = {}
    if args.niah_text is not None:
        tok = AutoTokenizer.from_pretrained(args.tokens)
        for which in ("heldout", "train", "legacy"):
            niah[which] = niah_own_cache(best_model, tok, args.niah_text.read_text("utf-8"), args.niah_n, which)
            print(f"NIAH {which} (own cache): {niah[which]['all']['correct']} of {niah[which]['all']['answers']}")
    log = {
        "config_sha256": hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest(),
        "train_tokens_sha256": sha256_file(args.tokens / "train.u16.npy"),
        "validation_tokens_sha256": sha256_file(args.tokens / "validation.u16.npy"),
        "parameters": n_params,
        "init_sha256": init_sha,
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps_run": step + 1,
        "tokens_seen": (step + 1) * args.batch * args.seq,
        "retrieval_rows_seen": (step + 1) * (round(args.retrieval_share * args.batch) if mix is not None else 0),
        "train_seconds": train_seconds,
        "best_val_loss": best[0],
        "best_val_ppl": math.exp(best[0]),
        "best_step": best[1],
        "shipped_bf16_loss_whole_split": final,
        "shipped_bf16_ppl_whole_split": {k: math.exp(v) for k, v in final.items()},
        "niah_own_cache": niah,
        "curve": curve,
    }
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([c["step"] for c in curve], [c["train_loss"] for c in curve], label="train (batch)")
        ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve], label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(f"tiny-{args.family}, {n_params / 1e6:.1f}M params")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "loss_curve.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no loss_curve.png")
    print(json.dumps({k: v for k, v in log.items() if k != "curve"}, indent=2))


if __name__ == "__main__":
    main()
