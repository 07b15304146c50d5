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
                       "kernel_us": 800, "kernels": 1, "gpu_ops": 1}  # fmt: skip
    assert {e["kernel_us"] for e in each[1:]} == {55}  # the kernel between steps is in none
    assert {e["kernels"] for e in each[1:]} == {4}


def test_copies_and_memsets_count_as_gpu_ops_not_kernel_time():
    ev = _trace() + [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1200, "dur": 30},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 1210, "dur": 2},
    ]
    each = _module().summarise(ev, top=1)["each"]
    assert (each[1]["kernels"], each[1]["gpu_ops"], each[1]["kernel_us"]) == (4, 6, 55)
    assert each[2]["gpu_ops"] == 4


def _host(t: int, name: str, dur: int) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": t, "dur": dur}


def test_the_hosts_side_of_each_step():
    ev = _trace()
    names = [e["name"] for e in ev if e["cat"] == "gpu_user_annotation"]
    # the host issues step i over [1000 i - 500, 1000 i + 100]: it ends issuing step i 100 us after the GPU
    # began it; the GPU ended step 0 at 900 and each decode step 300 us after its start
    ev += [_host(1000 * i - 500, n, 600) for i, n in enumerate(names)]
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1000 * i - 400 + j, "dur": 1}
           for i in range(5) for j in range(i)]  # fmt: skip
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150, "dur": 1})  # after step 0
    each = _module().summarise(ev, top=1)["each"]
    assert [e["host_start_us"] for e in each] == [-500, 500, 1500, 2500, 3500]
    assert [e["host_runtime_calls"] for e in each] == [0, 1, 2, 3, 4]
    assert [e["host_issue_end_after_previous_gpu_end_us"] for e in each] == [None, 200, 800, 800, 800]


def test_no_hosts_side_when_the_timelines_do_not_pair():
    ev = _trace() + [_host(0, "execute_context_2(64)_generation_0(0)", 10)]  # one host mark for five steps
    each = _module().summarise(ev, top=1)["each"]
    assert all("host_span_us" not in e for e in each)


def test_a_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such trace or folder: .*nowhere"):
        _module().traces(tmp_path / "nowhere")


def test_a_single_trace_or_a_folder_of_schemes(tmp_path):
    (tmp_path / "c4r4").mkdir()
    trace = tmp_path / "c4r4" / "w0.pt.trace.json.gz"
    trace.write_bytes(b"")
    assert _module().traces(tmp_path) == [("c4r4", trace)]
    assert _module().traces(trace) == [("w0", trace)]
