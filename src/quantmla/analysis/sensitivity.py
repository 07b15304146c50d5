"""Per-layer dual-path analysis driver: capture a layer, perturb each path, decompose the response."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from quantmla.analysis.response import (
    PATHS,
    SHAPES,
    Accumulator,
    decomposition,
    nmse_scale,
    path_function,
    probe_sums,
    raw_perturbation,
)
from quantmla.formats.scheme import parse_scheme
from quantmla.measure.attention import run_attention
from quantmla.measure.capture import capture_attention_call
from quantmla.models.adapter import get_adapter
from quantmla.models.latent import enable_latent_attention, is_latent_attention_enabled


@dataclass(frozen=True)
class AnalysisConfig:
    shapes: tuple[str, ...] = SHAPES
    quantizer: str = "c4r4"  # the quantiser whose residual shapes the "quant" perturbation, per path
    group_size: int = 64
    nmse: float = 0.01
    check_nmse: float = 1e-4  # where the linearisation is checked against the measured response
    probes: int = 8
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [s for s in self.shapes if s not in SHAPES]
        if bad or not self.shapes:
            raise ValueError(f"perturbation shapes {list(self.shapes)}; valid: {SHAPES}")
        scheme = parse_scheme(self.quantizer)
        unquantised = [p for p, f in (("content", scheme.content), ("RoPE key", scheme.rope)) if not f.quantized]
        if "quant" in self.shapes and unquantised:
            # the 'quant' perturbation of a path the scheme leaves unquantised is zero (fp8 keeps the RoPE key BF16)
            raise ValueError(
                f"quantizer={self.quantizer!r} leaves the {' and '.join(unquantised)} unquantised, so its 'quant' "
                "perturbation is zero there; valid: a scheme quantising both paths, c<b>r<b> (e.g. c4r4, c2r4, c8r8)"
            )
        if not 0 < self.check_nmse < 1 or not 0 < self.nmse < 1:
            raise ValueError(f"nmse={self.nmse} and check_nmse={self.check_nmse} must lie in (0, 1)")
        if self.probes < 1 or self.batch_size < 1:
            raise ValueError(f"probes={self.probes} and batch_size={self.batch_size} must be >= 1")


@dataclass
class LayerReport:
    layer: int
    results: dict  # path -> shape -> decomposition (response, factors, cache_nmse)
    linear_check: dict  # path -> measured response at check_nmse / linear prediction (gaussian shape)
    seconds: float

    def ratio(self, shape: str) -> float:
        c, r = self.results["content"][shape]["response"], self.results["rope"][shape]["response"]
        return r / c if c > 0 else float("inf")


@dataclass
class AnalysisReport:
    config: AnalysisConfig
    layers: list[LayerReport] = field(default_factory=list)
    dtype: str = ""  # the model's dtype that ran (e.g. "float32")
    device: str = ""  # the device that ran

    def model_level(self) -> dict:
        """Mean response over layers per path and shape, and RoPE/content ratio of the means."""
        out = {}
        for shape in self.config.shapes:
            c = sum(lr.results["content"][shape]["response"] for lr in self.layers) / len(self.layers)
            r = sum(lr.results["rope"][shape]["response"] for lr in self.layers) / len(self.layers)
            out[shape] = {"content": c, "rope": r, "ratio": r / c if c > 0 else float("inf")}
        return out

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "dtype": self.dtype,
            "device": self.device,
            "layers": [asdict(lr) | {"ratio": {s: lr.ratio(s) for s in self.config.shapes}} for lr in self.layers],
            "model": self.model_level(),
        }


def _generator(device, *key: int) -> torch.Generator:
    g = torch.Generator(device=device)
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k)) % (2**62)
    return g.manual_seed(seed)


def analyze_layer(model: nn.Module, index: int, windows: torch.Tensor, cfg: AnalysisConfig) -> LayerReport:
    """Responses and decomposition of attention module ``index`` over token ``windows [N, T]``."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    scheme = parse_scheme(cfg.quantizer)
    fmts = {"content": scheme.content, "rope": scheme.rope}
    batches = [windows[i : i + cfg.batch_size].to(device) for i in range(0, len(windows), cfg.batch_size)]
    calls = [capture_attention_call(model, index, b) for b in batches]
    with torch.no_grad():
        clean = [run_attention(call) for call in calls]  # (out, c, r) per batch

    def raw(b: int, path: str, shape: str) -> torch.Tensor:
        x = clean[b][1] if path == "content" else clean[b][2]
        gen = _generator(x.device, cfg.seed, index, b, PATHS.index(path), SHAPES.index(shape))
        return raw_perturbation(x, shape, fmts[path], cfg.group_size, gen)

    results: dict = {p: {} for p in PATHS}
    check: dict = {}
    for path in PATHS:
        cache_sq = sum(float((c if path == "content" else r).double().pow(2).sum()) for _, c, r in clean)
        out_sq = sum(float(o.double().pow(2).sum()) for o, _, _ in clean)
        for shape in cfg.shapes:
            raw_sq = sum(float(raw(b, path, shape).double().pow(2).sum()) for b in range(len(calls)))
            scale = nmse_scale(cache_sq, raw_sq, cfg.nmse)
            acc = Accumulator(cache_sq=cache_sq, out_sq=out_sq, probes=cfg.probes)
            for b, call in enumerate(calls):
                delta = raw(b, path, shape) * scale
                fn = path_function(call, path)
                with torch.no_grad():
                    dout = fn(delta) - clean[b][0]
                acc.add({"delta_sq": float(delta.double().pow(2).sum()), "dout_sq": float(dout.double().pow(2).sum())})
                gen = _generator(device, cfg.seed, index, b, PATHS.index(path), SHAPES.index(shape), 7)
                acc.add(probe_sums(fn, torch.zeros_like(delta), delta, cfg.probes, gen))
            results[path][shape] = decomposition(acc, cfg.nmse)
        # linearisation check: the measured response at a small NMSE against kappa * Rayleigh quotient
        shape = "gaussian"
        raw_sq = sum(float(raw(b, path, shape).double().pow(2).sum()) for b in range(len(calls)))
        scale = nmse_scale(cache_sq, raw_sq, cfg.check_nmse)
        dout_sq = delta_sq = rayleigh = 0.0
        for b, call in enumerate(calls):
            delta = raw(b, path, shape) * scale
            fn = path_function(call, path)
            with torch.no_grad():
                dout_sq += float((fn(delta) - clean[b][0]).double().pow(2).sum())
            delta_sq += float(delta.double().pow(2).sum())
            rayleigh += float(
                torch.func.jvp(fn, (torch.zeros_like(delta),), (delta,))[1].detach().double().pow(2).sum()
            )
        measured = (dout_sq / out_sq) / (delta_sq / cache_sq)
        linear = (cache_sq / out_sq) * rayleigh / delta_sq
        check[path] = {"measured": measured, "linear": linear, "ratio": measured / linear if linear > 0 else 0.0}
    return LayerReport(index, results, check, time.perf_counter() - t0)


def analyze(model: nn.Module, windows: torch.Tensor, cfg: AnalysisConfig, layers=None, progress=True):
    """Analyse every MLA attention module (or the cache indices in ``layers``), one at a time."""
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    indices = [i for i, _ in get_adapter(model).attention_modules(model)]
    if layers is not None:
        bad = [i for i in layers if i not in indices]
        if bad:
            raise ValueError(f"layers {bad} not in this model's attention modules; valid: {indices}")
        indices = list(layers)
    param = next(model.parameters())
    report = AnalysisReport(cfg, dtype=str(param.dtype).removeprefix("torch."), device=str(param.device))
    for i in tqdm(indices, desc="analyze", unit="layer", disable=not progress):
        report.layers.append(analyze_layer(model, i, windows, cfg))
    return report
