"""The dual-path analysis against references that share none of its code: transformers' own (sdpa)
attention module with the perturbation added to the cache it reads, in float64; finite differences
instead of forward-mode AD; the probe estimates against a brute-force Jacobian and their own variance."""

import json

import pytest
import torch
from typer.testing import CliRunner

from quantmla import enable_latent_attention
from quantmla.analysis import AnalysisConfig, analyze
from quantmla.analysis.report import write
from quantmla.analysis.response import path_function, probe_sums
from quantmla.cli.main import app
from quantmla.formats import parse_scheme
from quantmla.measure.attention import run_attention
from quantmla.measure.capture import capture_attention_call
from quantmla.models import get_adapter
from quantmla.models.compat import CACHE_KWARG
from tiny_models import tiny_model

NAME, LAYER = "deepseek_v3", 1


def _model(name=NAME, dtype=torch.float64):
    return enable_latent_attention(tiny_model(name, dtype=dtype))


class _AddToCache:
    """The cache the stock attention module reads: hands back the latent and RoPE key plus fixed deltas."""

    def __init__(self, dc=None, dr=None):
        self.dc, self.dr, self.c, self.r = dc, dr, None, None

    def update(self, c, r, layer_idx, *args, **kwargs):
        self.c, self.r = c, r
        return (c if self.dc is None else c + self.dc), (r if self.dr is None else r + self.dr)


class StockAttention:
    """Module ``index`` of the stock model (transformers' sdpa attention in float64; its eager path takes the
    softmax in float32) as a function of deltas added to its cache; inputs captured by this test's own hook."""

    def __init__(self, model, index, ids):
        self.attn = dict(get_adapter(model).attention_modules(model))[index]
        seen = {}

        def hook(mod, args, kwargs):
            seen["a"] = (args, kwargs)
            raise StopIteration

        h = self.attn.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                model(ids, use_cache=False)
        except StopIteration:
            pass
        finally:
            h.remove()
        self.args, kw = seen["a"]
        self.kwargs = {k: v for k, v in kw.items() if k not in ("cache", "past_key_values", "use_cache")}
        self.out, self.c, self.r = self(None, None, keep=True)

    def __call__(self, dc=None, dr=None, keep=False):
        cache = _AddToCache(dc, dr)
        with torch.no_grad():
            out = self.attn(*self.args, **self.kwargs, **{CACHE_KWARG: cache})[0]
        return (out, cache.c, cache.r) if keep else out

    def path(self, path, d):
        return self(dc=d) if path == "content" else self(dr=d)


def _stock(ids, index=LAYER, edit=None):
    model = tiny_model(NAME, dtype=torch.float64, attn_implementation="sdpa")
    if edit is not None:
        edit(model)
    return StockAttention(model, index, ids)


def _sq(x):
    return float(x.double().pow(2).sum())


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (4, 24))
    cfg = AnalysisConfig(probes=2, batch_size=2, nmse=0.01)  # two batches: the NMSE is set over both
    return ids, cfg, analyze(_model(), ids, cfg, layers=[LAYER], progress=False).layers[0]


def test_quant_response_equals_the_stock_attention_reference(setup):
    """The 'quant' perturbation is deterministic (the quantiser's residual at the NMSE asked for): rebuild it
    on the stock module's cache, measure its NMSE, and measure NMSE(out) / NMSE(cache) there."""
    ids, cfg, lr = setup
    ref = _stock(ids)
    fmt = parse_scheme(cfg.quantizer)
    for path, x, f in (("content", ref.c, fmt.content), ("rope", ref.r, fmt.rope)):
        raw = f.fake_quantize(x, cfg.group_size) - x

        def response(nmse, raw=raw, x=x, path=path):
            delta = raw * (nmse * _sq(x) / _sq(raw)) ** 0.5
            measured_nmse = _sq(delta) / _sq(x)
            assert measured_nmse == pytest.approx(nmse, rel=1e-12)
            return (_sq(ref.path(path, delta) - ref.out) / _sq(ref.out)) / measured_nmse

        got = lr.results[path]["quant"]
        assert got["response"] == pytest.approx(response(cfg.nmse), rel=1e-8), path
        assert got["cache_nmse"] == pytest.approx(cfg.nmse, rel=1e-12)
        # the check can fail: the response at a 10% different NMSE is far outside the tolerance
        assert abs(response(1.1 * cfg.nmse) / got["response"] - 1) > 1e-5, path


def test_linear_response_equals_a_finite_difference(setup):
    """kappa * ||J delta||^2 / ||delta||^2 (forward-mode AD through the absorbed path) against a float64
    central difference of the stock module along the same delta."""
    ids, cfg, lr = setup
    ref = _stock(ids)
    fmt = parse_scheme(cfg.quantizer)
    for path, x, f in (("content", ref.c, fmt.content), ("rope", ref.r, fmt.rope)):
        delta = f.fake_quantize(x, cfg.group_size) - x
        h = 1e-4 * (_sq(x) / _sq(delta)) ** 0.5
        j_delta = (ref.path(path, h * delta) - ref.path(path, -h * delta)) / (2 * h)
        linear = (_sq(x) / _sq(ref.out)) * _sq(j_delta) / _sq(delta)
        assert lr.results[path]["quant"]["linear_response"] == pytest.approx(linear, rel=1e-6), path


def test_linearisation_matches_measurement_at_small_nmse(setup):
    for path in ("content", "rope"):
        assert abs(setup[2].linear_check[path]["ratio"] - 1) <= 0.05, setup[2].linear_check


def test_probe_estimates_against_a_brute_force_jacobian():
    """Hutchinson sums against tr(J^T J) and sum_i (J^T J)_ii w_i of a Jacobian built column by column
    by finite differences of the stock module, within 5 standard deviations of the estimators."""
    ids = torch.randint(3, 256, (1, 3))
    ref = _stock(ids)
    call = capture_attention_call(_model(), LAYER, ids)
    probes = 200
    for path, x in (("content", ref.c), ("rope", ref.r)):
        n, h = x.numel(), 1e-5
        cols = []
        for i in range(n):
            e = torch.zeros(n, dtype=x.dtype)
            e[i] = h
            e = e.view_as(x)
            cols.append(((ref.path(path, e) - ref.path(path, -e)) / (2 * h)).flatten())
        a = torch.stack(cols, 1).T @ torch.stack(cols, 1)  # J^T J, [n, n]
        g = torch.Generator().manual_seed(0)
        delta = torch.randn(x.shape, generator=g, dtype=x.dtype)
        fn = path_function(call, path)
        s = probe_sums(fn, torch.zeros_like(x), delta, probes, g)
        w = (delta * delta).flatten()
        off = a.pow(2) * (w[:, None] + w[None, :]).pow(2)
        var_diag = 0.5 * float(off.sum() - off.diagonal().sum())  # per probe: 1/2 sum_{i!=j} A_ij^2 (w_i+w_j)^2
        var_trace = 2 * float(a.pow(2).sum() - a.diagonal().pow(2).sum())
        assert abs(s["trace"] / probes - float(torch.trace(a))) <= 5 * (var_trace / probes) ** 0.5
        assert abs(s["diag_w"] / probes - float(a.diagonal() @ w)) <= 5 * (var_diag / probes) ** 0.5
        assert s["rayleigh"] == pytest.approx(float(delta.flatten() @ a @ delta.flatten()), rel=1e-6)


def _scale_query(model, rope: float, nope: float) -> None:
    """Scale each head's RoPE query rows by ``rope`` and its content (nope) query rows by ``nope``."""
    adapter = get_adapter(model)
    with torch.no_grad():
        for _, attn in adapter.attention_modules(model):
            w = adapter.q_proj(attn).weight
            rope_rows = adapter.q_rope_rows(attn).flatten()
            nope_rows = torch.ones(w.shape[0], dtype=torch.bool)
            nope_rows[rope_rows] = False
            w[rope_rows] *= rope
            w[nope_rows] *= nope


def test_ratio_sign_on_constructed_cases():
    """With the RoPE query zeroed the RoPE key cannot move the output (ratio 0); with the content query
    zeroed and the RoPE query scaled up, only the RoPE key steers the (sharp) softmax and the content
    latent only enters through the values: the RoPE path must matter more (ratio > 1)."""
    ids = torch.randint(3, 256, (2, 32))
    cfg = AnalysisConfig(probes=2)
    for (rope, nope), expect in (((0.0, 1.0), "zero"), ((8.0, 0.0), "rope")):
        model = _model()
        _scale_query(model, rope, nope)
        rep = analyze(model, ids, cfg, progress=False)
        for lr in rep.layers:
            for shape in ("gaussian", "quant"):
                c, r = lr.results["content"][shape]["response"], lr.results["rope"][shape]["response"]
                assert c > 0.0
                if expect == "zero":
                    assert r == 0.0 and lr.ratio(shape) == 0.0
                else:
                    assert lr.ratio(shape) > 1.0, (lr.layer, shape, c, r)
        # the same ordering in the stock module's own response to the same quantiser residual
        ref = _stock(ids, index=0, edit=lambda m, rope=rope, nope=nope: _scale_query(m, rope, nope))
        resp = {}
        for path, x, f in (
            ("content", ref.c, parse_scheme("c4r4").content),
            ("rope", ref.r, parse_scheme("c4r4").rope),
        ):
            d = f.fake_quantize(x, 64) - x
            d = d * (0.01 * _sq(x) / _sq(d)) ** 0.5
            resp[path] = _sq(ref.path(path, d) - ref.out) / _sq(ref.out) / 0.01
        assert (resp["rope"] == 0.0) if expect == "zero" else (resp["rope"] > resp["content"]), resp


def test_clean_outputs_of_both_paths_agree():
    """The analysed module's clean output and cache equal the stock module's (float64)."""
    ids = torch.randint(3, 256, (2, 12))
    out, c, r = run_attention(capture_attention_call(_model(), LAYER, ids))
    ref = _stock(ids)
    assert torch.allclose(out, ref.out, rtol=0, atol=1e-12) and torch.equal(c, ref.c) and torch.equal(r, ref.r)


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
    assert untimed(files[0]["json"])["dtype"] == "float64" and untimed(files[0]["json"])["device"] == "cpu"
    other = analyze(_model(), ids, AnalysisConfig(probes=2, seed=4), progress=False)
    assert json.loads(files[0]["json"].read_text())["layers"][0] != other.to_dict()["layers"][0]


def test_config_errors():
    with pytest.raises(ValueError, match="valid: \\('gaussian', 'quant'\\)"):
        AnalysisConfig(shapes=("uniform",))
    for q in ("bf16", "fp8"):  # fp8 keeps the RoPE key in BF16: no 'quant' perturbation there
        with pytest.raises(ValueError, match=f"quantizer='{q}' leaves the .*unquantised") as e:
            AnalysisConfig(quantizer=q)
        assert "fp8" not in str(e.value).split("valid:")[1]
    AnalysisConfig(quantizer="fp8", shapes=("gaussian",))  # the gaussian shape does not use the quantiser


def test_cli_analyze(tmp_path):
    res = CliRunner().invoke(
        app, ["analyze", "--num-seqs", "2", "--seq-len", "64", "--layers", "0,3", "--probes", "2",
              "--device", "cpu", "--out", str(tmp_path), "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{") :])
    assert [lr["layer"] for lr in data["layers"]] == [0, 3]
    assert (data["model_name"], data["dtype"], data["device"]) == ("builtin:tiny-mla", "float32", "cpu")
    assert {"gaussian", "quant"} <= set(data["model"])
    assert (tmp_path / "analysis.png").stat().st_size > 1000 and (tmp_path / "analysis.csv").exists()
