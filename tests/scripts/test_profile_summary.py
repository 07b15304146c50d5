"""The profile summary splits vLLM's steps by their annotation into decode and prefill steps and divides the
kernels inside each step's span by the steps."""

from functools import partial

import pytest

from script_modules import load_script

_module = partial(load_script, "scripts/profile_summary.py")


def _step(t: int, name: str, dur: int) -> dict:
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": t, "dur": dur}


def _kernel(t: int, name: str, dur: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur}


def _trace() -> list[dict]:
    ev = [_step(0, "execute_context_2(64)_generation_0(0)", 900), _kernel(10, "prefill_attn", 800)]
    for s in range(1, 5):  # decode steps every 1000 us
        t = 1000 * s
        ev.append(_step(t, "execute_context_0(0)_generation_2(2)", 300))
        ev += [_kernel(t + 10 * i, "attn", 5) for i in range(3)]
        ev.append(_kernel(t + 50, "gemm", 40))
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 50, "dur": 7})  # not a kernel
    ev.append(_kernel(4600, "between_steps", 100))  # outside every step's span
    return ev


def test_decode_and_prefill_steps_apart():
    s = _module().summarise(_trace(), top=1)
    assert len(s["steps"]) == 5
    d = s["decode"]
    assert d["steps"] == 4 and d["step_period_us"] == 1000
    assert d["gpu_span_us_per_step"] == 300 and d["kernel_us_per_step"] == 55
    assert d["kernels"] == [{"name": "gemm", "us_per_step": 40, "launches_per_step": 1}]
    p = s["prefill"]
    assert p["steps"] == 1 and p["step_period_us"] is None and p["kernel_us_per_step"] == 800


def test_a_trace_without_steps_is_refused():
    with pytest.raises(ValueError, match="not a vLLM worker's trace"):
        _module().summarise([_kernel(0, "k", 1)], top=3)


def test_each_step_in_order_with_its_span_and_kernels():
    each = _module().summarise(_trace(), top=1)["each"]
    assert [e["start_us"] for e in each] == [0, 1000, 2000, 3000, 4000]
    assert each[0] == {"name": "execute_context_2(64)_generation_0(0)", "start_us": 0, "gpu_span_us": 900,
                       "kernel_us": 800}  # fmt: skip
    assert {e["kernel_us"] for e in each[1:]} == {55}  # the kernel between steps is in none
