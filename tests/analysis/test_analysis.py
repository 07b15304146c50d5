import json

import pytest
import torch
from typer.testing import CliRunner

from quantmla import enable_latent_attention
from quantmla.analysis import AnalysisConfig, analyze
from quantmla.analysis.capture import capture_attention_call
from quantmla.analysis.report import write
from quantmla.analysis.response import path_function, probe_sums, run_attention
from quantmla.cli.main import app
from quantmla.models import get_adapter
from tiny_models import tiny_model


def _model(name="deepseek_v3", dtype=torch.float64):
    return enable_latent_attention(tiny_model(name, dtype=dtype))


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    return analyze(_model(), torch.randint(3, 256, (4, 48)), AnalysisConfig(probes=4, batch_size=2), progress=False)


def test_perturbation_nmse_is_exact(report):
    for lr in report.layers:
        for path in ("content", "rope"):
            for shape in ("gaussian", "quant"):
                assert abs(lr.results[path][shape]["cache_nmse"] - 0.01) <= 1e-6


def test_linearisation_matches_measurement_at_small_nmse(report):
    for lr in report.layers:
        for path in ("content", "rope"):
            assert abs(lr.linear_check[path]["ratio"] - 1) <= 0.05, lr.linear_check
            d = lr.results[path]["gaussian"]
            product = d["kappa"] * d["avg_sensitivity"] * d["allocation"] * d["coupling"]
            assert product == pytest.approx(d["linear_response"], rel=1e-9)


def test_zeroed_rope_query_weights_give_zero_rope_response():
    model = _model()
    adapter = get_adapter(model)
    with torch.no_grad():
        for _, attn in adapter.attention_modules(model):
            adapter.q_proj(attn).weight[adapter.q_rope_rows(attn).flatten()] = 0.0
    rep = analyze(model, torch.randint(3, 256, (2, 32)), AnalysisConfig(probes=2), progress=False)
    for lr in rep.layers:
        for shape in ("gaussian", "quant"):
            assert lr.results["rope"][shape]["response"] == 0.0
            assert lr.results["content"][shape]["response"] > 0.0


def test_probe_estimates_match_the_exact_jacobian():
    model = _model()
    call = capture_attention_call(model, 1, torch.randint(3, 256, (1, 6)))
    out, c, r = run_attention(call)
    for path, x in (("content", c), ("rope", r)):
        fn = path_function(call, path)
        zero = torch.zeros_like(x)
        jac = torch.func.jacfwd(fn)(zero).reshape(out.numel(), x.numel())
        a = jac.T @ jac
        g = torch.Generator().manual_seed(0)
        delta = torch.randn(x.shape, generator=g, dtype=x.dtype)
        s = probe_sums(fn, zero, delta, 400, g)
        w = (delta * delta).flatten()
        assert s["trace"] / 400 == pytest.approx(torch.trace(a).item(), rel=0.1)
        assert s["diag_w"] / 400 == pytest.approx((torch.diagonal(a) * w).sum().item(), rel=0.1)
        assert s["rayleigh"] == pytest.approx((delta.flatten() @ a @ delta.flatten()).item(), rel=1e-9)


def test_outputs_are_deterministic_for_a_seed(tmp_path):
    ids = torch.randint(3, 256, (2, 32))
    files = []
    for run in ("a", "b"):
        rep = analyze(_model(), ids, AnalysisConfig(probes=2, seed=3), progress=False)
        files.append(write(rep, tmp_path / run, "t"))
    assert files[0]["png"].read_bytes() == files[1]["png"].read_bytes()

    def untimed(f):
        data = json.loads(f.read_text())
        for lr in data["layers"]:
            lr.pop("seconds")
        return data

    assert untimed(files[0]["json"]) == untimed(files[1]["json"])
    other = analyze(_model(), ids, AnalysisConfig(probes=2, seed=4), progress=False)
    assert json.loads(files[0]["json"].read_text())["layers"][0] != other.to_dict()["layers"][0]


def test_config_errors():
    with pytest.raises(ValueError, match="valid: \\('gaussian', 'quant'\\)"):
        AnalysisConfig(shapes=("uniform",))
    with pytest.raises(ValueError, match="does not quantise"):
        AnalysisConfig(quantizer="bf16")


def test_cli_analyze(tmp_path):
    res = CliRunner().invoke(
        app, ["analyze", "--num-seqs", "2", "--seq-len", "64", "--layers", "0,3", "--probes", "2",
              "--out", str(tmp_path), "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{") :])
    assert [lr["layer"] for lr in data["layers"]] == [0, 3]
    assert {"gaussian", "quant"} <= set(data["model"])
    assert (tmp_path / "analysis.png").stat().st_size > 1000 and (tmp_path / "analysis.csv").exists()
    bad = CliRunner().invoke(app, ["analyze", "--layers", "99", "--num-seqs", "1", "--seq-len", "16"])
    assert bad.exit_code != 0 and "layers [99] not in" in bad.output
