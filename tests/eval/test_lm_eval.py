"""`quantmla eval lm-eval`: lm-eval's HFLM over the bundled model with a quantised cache, on local tasks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantmla.cli.main import app

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra quantmla[eval]")

TASKS = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The local task files, their data paths made absolute (datasets resolves them from the cwd)."""
    d = tmp_path_factory.mktemp("tasks")
    for f in TASKS.iterdir():
        shutil.copy(f, d / f.name)
    for y in d.glob("*.yaml"):
        text = y.read_text()
        for name in ("tiny_mc.jsonl", "tiny_gen.jsonl"):
            text = text.replace(f"test: {name}", f"test: {d / name}")
        y.write_text(text)
    return d


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_cli_runs_local_tasks_through_the_cache(task_dir):
    result = cli("eval", "lm-eval", "--tasks", "quantmla_tiny_mc,quantmla_tiny_gen", "--scheme", "bf16,c2r4",
                 "--include-path", str(task_dir), "--sink", "0", "--recent", "0", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{") :])
    assert set(out["runs"]) == {"bf16", "c2r4"}
    for run in out["runs"].values():
        mc, gen = run["results"]["quantmla_tiny_mc"], run["results"]["quantmla_tiny_gen"]
        assert 0.0 <= mc["acc,none"] <= 1.0 and 0.0 <= gen["starts_with,none"] <= 1.0
    # the bundled model knows kernel C and retrieves a needle stated just before the question
    assert out["runs"]["bf16"]["results"]["quantmla_tiny_mc"]["acc,none"] == 1.0
    assert out["runs"]["bf16"]["results"]["quantmla_tiny_gen"]["starts_with,none"] == 1.0


def test_the_scheme_reaches_both_request_kinds(monkeypatch):
    """Log-likelihoods run under the decode-cache simulation and generations get a QuantizedLatentCache of the
    requested scheme: both are seen here, so a cache that silently stayed unquantised would fail."""
    import quantmla
    from quantmla.cache import QuantizedLatentCache
    from quantmla.eval import lm_eval_adapter
    from quantmla.measure import simulate

    model, tok = quantmla.load()
    seen = {"sim": [], "cache": []}
    real_sim, real_init = simulate.simulated_decode, QuantizedLatentCache.__init__

    def spy_sim(m, scheme, *a, **k):
        seen["sim"].append(scheme)
        return real_sim(m, scheme, *a, **k)

    def spy_init(self, config, scheme="c4r4", *a, **k):
        seen["cache"].append(scheme)
        real_init(self, config, scheme, *a, **k)

    monkeypatch.setattr(simulate, "simulated_decode", spy_sim)
    monkeypatch.setattr(QuantizedLatentCache, "__init__", spy_init)
    lm = lm_eval_adapter.lm_eval_model(model, tok, lm_eval_adapter.LmEvalCache(scheme="c2r4", sink=0, recent=0))
    ids = tok("#include <linux/module.h>\n#include <linux/init.h>", add_special_tokens=False)["input_ids"]
    logits_q = lm._model_call(torch.tensor([ids]))
    lm_bf16 = lm_eval_adapter.lm_eval_model(model, tok, lm_eval_adapter.LmEvalCache(scheme="bf16", sink=0, recent=0))
    logits_b = lm_bf16._model_call(torch.tensor([ids]))
    assert seen["sim"] == ["c2r4", "bf16"]
    assert not torch.allclose(logits_q, logits_b)  # INT2 content with no windows moves the logits
    lm._model_generate(torch.tensor([ids]), len(ids) + 3, ["\n"])
    assert seen["cache"][-1] == "c2r4"


def test_unknown_task_is_one_line(task_dir):
    result = cli("eval", "lm-eval", "--tasks", "no_such_task", "--include-path", str(task_dir))
    assert result.exit_code == 2 and "no_such_task" in result.output and "Traceback" not in result.output
