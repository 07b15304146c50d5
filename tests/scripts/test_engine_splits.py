"""``benchmarks/experiments/engine_splits.py --device cpu``: the kernel sweep's dry run. Every variant the GPU
sweep (``scripts/serving_gpu.sh sweep``) times runs here under Triton's interpreter, so a call of the sweep
cannot be spent on a variant that does not run; a run cut short keeps the cases it finished."""

import json
import os
import sys

import pytest

from script_modules import load_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a dry run in Triton's interpreter")


def test_dry_run_times_every_variant_and_keeps_finished_cases(tmp_path, monkeypatch):
    es = load_script("benchmarks/experiments/engine_splits.py")
    out = tmp_path / "splits.json"
    # the second case has more real requests than its graph's batch: it fails after the first has finished
    argv = ["engine_splits.py", "--device", "cpu", "--layers", "1", "--repeats", "1", "--splits", "3",
            "--fp16-partials", "--chunks", "64", "--window-splits", "2", "--launches", "32/4/2", "--scheme", "c2r4",
            "--cases", "1x200/2/512,3x200/2/512", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError):
        es.main()
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    row = rows[0]
    assert (row["scheme"], row["real"], row["L"], row["graph_batch"]) == ("c2r4", 1, 200, 2)
    timed = {k for k in row if k.endswith("_us")}
    assert timed == {"splits_half_us", "splits_default_us", "splits_3_us", "combine_chunk_64_us",
                     "window_splits_2_us", "fp16_partials_splits_default_us", "fp16_partials_splits_3_us",
                     "launch_32_4_2_us", "one_layer_repeated_us"}  # fmt: skip
    assert all(row[k] > 0 for k in timed)
    import quantmla.kernels.decode as dec

    assert dec.COMBINE_CHUNK == 32  # the sweep puts the combine's step back
