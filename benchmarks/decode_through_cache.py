"""Decoding *through the cache*: tokens/s of ``model.generate()`` with a QuantizedLatentCache (bf16, c4r4,
c2r4; ``backend="auto"``, which is the triton kernel for a BF16 model on CUDA) and transformers' own
DynamicCache (stock attention, re-expanding the latent every step) as the baseline.

Model: DeepSeek-V2-Lite-shaped attention (kv_lora_rank 512, RoPE 64, 16 heads, nope 128, v 128, no query
compression), dense MLPs, a few layers, random weights from ``DeepseekV3Config`` (no hub), BF16.

Each cell: the cache is filled with ``L`` random latent tokens (the prompt's cache; prefill is not
timed), then ``generate()`` produces ``--new-tokens`` tokens greedily (the first forward processes the
one uncached prompt token). Median of ``--runs`` runs after a warm-up. Columns:

* ``generate tok/s``: ``B * new_tokens / time`` of the whole ``generate()`` call (eager: transformers
  runs the decode step in a CUDA graph / ``torch.compile`` only for a compileable, static-shape cache;
  these caches grow every step, so ``generate(compile_config=...)`` stays eager: said in the table);
* ``step ms eager`` / ``step ms graph``: one single-token forward through the cache, launched eagerly,
  and the same step captured once in a ``torch.cuda.CUDAGraph`` and replayed (the replay repeats that
  step at length ``L``: it measures launch overhead, it is not a generation loop); if capture fails the
  reason is printed in the table.

    PYTHONPATH=src python benchmarks/decode_through_cache.py --out $OUT/decode_through_cache.json
    PYTHONPATH=src python benchmarks/decode_through_cache.py --smoke --out /tmp/smoke.json   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # on CPU, --backend triton runs in Triton's interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

import quantmla
from quantmla.models import disable_latent_attention, enable_latent_attention, is_latent_attention_enabled
from quantmla.models.compat import cache_kwargs

logger = logging.getLogger(__name__)

SCHEMES = ("stock", "bf16", "c4r4", "c2r4")


def build_config(smoke: bool, layers: int) -> DeepseekV3Config:
    if smoke:
        dims = dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=128,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            vocab_size=256,
        )
    else:  # DeepSeek-V2-Lite's attention and dense MLP
        dims = dict(
            hidden_size=2048,
            intermediate_size=10944,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            vocab_size=102400,
        )
    return DeepseekV3Config(
        **dims,
        q_lora_rank=None,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,
        n_routed_experts=8,
        max_position_embeddings=65536,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


BACKEND = "auto"  # --backend


def filled_cache(model, scheme: str, B: int, L: int, seed: int = 0):
    """A cache holding ``L`` random latent tokens per layer, as a prefill would leave it."""
    cfg, dev = model.config, model.device
    if scheme == "stock":
        cache = DynamicCache()
    else:
        cache = quantmla.QuantizedLatentCache(cfg, scheme=scheme, backend=BACKEND)
    g = torch.Generator(device=dev).manual_seed(seed)
    for i in range(cfg.num_hidden_layers):
        c = torch.randn(B, 1, L, cfg.kv_lora_rank, generator=g, device=dev, dtype=torch.bfloat16)
        r = torch.randn(B, 1, L, cfg.qk_rope_head_dim, generator=g, device=dev, dtype=torch.bfloat16)
        cache.update(c, r, i)
    return cache


def set_attention(model, scheme: str) -> None:
    if scheme == "stock":
        if is_latent_attention_enabled(model):
            disable_latent_attention(model)
        model.set_attn_implementation("sdpa")
    elif not is_latent_attention_enabled(model):
        enable_latent_attention(model)


def time_generate(model, scheme, B, L, new_tokens, runs) -> tuple[list[float], object]:
    dev = model.device
    ids = torch.randint(3, model.config.vocab_size, (B, L + 1), device=dev)
    times, cache = [], None
    for run in range(runs + 1):  # the first is a warm-up
        cache = filled_cache(model, scheme, B, L, seed=run)
        sync(dev)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **cache_kwargs(cache),
        )
        sync(dev)
        if run:
            times.append(time.perf_counter() - t0)
        if out.shape[1] != L + 1 + new_tokens or cache.get_seq_length() != L + new_tokens:
            raise RuntimeError(
                f"generate() did not continue from the filled cache: {out.shape[1]} tokens out, cache holds "
                f"{cache.get_seq_length()} (expected {L + 1 + new_tokens} and {L + new_tokens})"
            )
    return times, cache


def time_steps(model, scheme, B, L, steps) -> tuple[float, float | None, str]:
    """(eager ms, graph ms or None, note) of one single-token forward through a cache of ``L`` tokens."""
    dev = model.device
    cache = filled_cache(model, scheme, B, L)
    tok = torch.randint(3, model.config.vocab_size, (B, 1), device=dev)
    kw = cache_kwargs(cache)

    def step():
        n = cache.get_seq_length()
        pos = torch.full((B, 1), n, device=dev, dtype=torch.long)
        return model(input_ids=tok, position_ids=pos, use_cache=True, **kw).logits

    with torch.no_grad():
        for _ in range(3):
            step()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(dev)
        eager = (time.perf_counter() - t0) / steps * 1e3
        if dev.type != "cuda":
            return eager, None, "no CUDA graph on CPU"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
        except Exception as e:  # report why capture failed, in the table
            return eager, None, f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        graph.replay()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        sync(dev)
        return eager, (time.perf_counter() - t0) / steps * 1e3, "captured; replays repeat one step"


def generate_graph_note(cache) -> str:
    if getattr(cache, "is_compileable", False):
        return "compileable cache"
    return f"generate() eager: {type(cache).__name__} is not compileable (it grows each step)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, to check the script")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt", type=int, nargs="+", default=[4096, 16384], help="cached tokens before decoding")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50, help="forwards per step timing")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument(
        "--backend", default="auto", choices=("auto", "torch", "triton"), help="QuantizedLatentCache backend"
    )
    args = ap.parse_args()
    global BACKEND
    BACKEND = args.backend
    if args.smoke:
        args.batch, args.prompt, args.new_tokens, args.runs, args.steps, args.layers = [2], [160], 3, 1, 2, 2
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("this benchmark needs a CUDA GPU (or --smoke for a CPU check)")
        dev = torch.device("cuda")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)  # the caches' own backend lines go to the table's notes instead
    torch.manual_seed(0)
    cfg = build_config(args.smoke, args.layers)
    with torch.device(dev):
        model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    for B in args.batch:
        for L in args.prompt:
            for scheme in args.schemes:
                set_attention(model, scheme)
                times, cache = time_generate(model, scheme, B, L, args.new_tokens, args.runs)
                eager_ms, graph_ms, graph_note = time_steps(model, scheme, B, L, args.steps)
                med = statistics.median(times)
                quantised = isinstance(cache, quantmla.QuantizedLatentCache)
                rows.append(
                    dict(
                        scheme=scheme,
                        batch=B,
                        prompt=L,
                        new_tokens=args.new_tokens,
                        backend=",".join(sorted(set(cache.backends_used()))) if quantised else "transformers sdpa",
                        backend_reason=cache.backend_reasons()[0] if quantised else "stock DeepseekV3 attention",
                        bytes_per_token=cache.bytes_per_token() if quantised else None,
                        generate_s=times,
                        generate_tok_s=B * args.new_tokens / med,
                        step_ms_eager=eager_ms,
                        step_ms_graph=graph_ms,
                        graph_note=graph_note,
                        generate_note=generate_graph_note(cache),
                    )
                )
                logger.info("%s", rows[-1])
                del cache
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = dict(
        device=gpu,
        torch=torch.__version__,
        layers=args.layers,
        runs=args.runs,
        smoke=args.smoke,
        config={
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "num_attention_heads",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "qk_nope_head_dim",
                "v_head_dim",
            )
        },
    )
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n{gpu}, {args.layers} layers, BF16, {args.new_tokens} new tokens, median of {args.runs} runs\n")
    print("| cache | backend | B | L | bytes/token | generate tok/s | step ms eager | step ms graph | graph |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        bpt = f"{r['bytes_per_token']:.1f}" if r["bytes_per_token"] is not None else "-"
        gms = f"{r['step_ms_graph']:.3f}" if r["step_ms_graph"] is not None else "-"
        print(
            f"| {r['scheme']} | {r['backend']} | {r['batch']} | {r['prompt']} | {bpt} | {r['generate_tok_s']:.1f} "
            f"| {r['step_ms_eager']:.3f} | {gms} | {r['graph_note']} |"
        )
    notes = sorted({r["generate_note"] for r in rows} | {f"{r['scheme']}: {r['backend_reason']}" for r in rows})
    print("\n" + "\n".join(f"* {n}" for n in notes))


if __name__ == "__main__":
    main()
