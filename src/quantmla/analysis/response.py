"""Dual-path sensitivity of MLA attention (METHOD.md section 2).

For one attention module and one cached path (content latent or RoPE key), perturb only that path's
cache so that its NMSE is exactly ``nmse`` and report

    response = NMSE(attention output) / NMSE(cache).

The linearised response splits into three factors, with J the Jacobian of the output with respect
to the path's cache, delta the perturbation and kappa = ||cache||^2 / ||output||^2:

    response ~= kappa * ||J delta||^2 / ||delta||^2
             = kappa * [tr(J^T J) / n] * allocation * coupling,
    allocation = (sum_i (J^T J)_ii delta_i^2 / ||delta||^2) / (tr(J^T J) / n)
    coupling   = (delta^T J^T J delta) / (sum_i (J^T J)_ii delta_i^2)

The trace and the delta-weighted diagonal are estimated with Rademacher probes and Jacobian-vector
products (forward-mode AD); no Jacobian is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.formats.scheme import PathFormat
from quantmla.measure.attention import run_attention
from quantmla.measure.capture import AttentionCall

PATHS = ("content", "rope")
SHAPES = ("gaussian", "quant")


def path_function(call: AttentionCall, path: str):
    """``delta -> attention output`` with ``delta`` added to one path's cache."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}; valid: {PATHS}")
    if path == "content":
        return lambda d: run_attention(call, delta_c=d)[0]
    return lambda d: run_attention(call, delta_r=d)[0]


def raw_perturbation(x: torch.Tensor, shape: str, fmt: PathFormat, group_size: int, gen: torch.Generator):
    """Unscaled perturbation of ``x``: isotropic Gaussian, or the residual of the real quantiser."""
    if shape == "gaussian":
        return torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
    if shape == "quant":
        return fmt.fake_quantize(x, group_size) - x
    raise ValueError(f"perturbation shape {shape!r}; valid: {SHAPES}")


def jvp(fn, primal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    return torch.func.jvp(fn, (primal,), (tangent,))[1]


@dataclass
class Accumulator:
    """Sums over batches for one (path, shape)."""

    cache_sq: float = 0.0
    out_sq: float = 0.0
    delta_sq: float = 0.0
    dout_sq: float = 0.0
    trace: float = 0.0  # sum over probes of ||J v||^2
    diag_w: float = 0.0  # sum over probes of <J (v * delta^2), J v>
    rayleigh: float = 0.0  # ||J delta||^2
    n: int = 0
    probes: int = 1  # probes per batch (the sums run over batches, each with this many probes)

    def add(self, other: dict) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)


def decomposition(acc: Accumulator, nmse: float) -> dict:
    """Response and its three linear factors from the accumulated sums."""
    kappa = acc.cache_sq / acc.out_sq
    response = (acc.dout_sq / acc.out_sq) / (acc.delta_sq / acc.cache_sq)
    avg = acc.trace / (acc.probes * acc.n)
    weighted_diag = acc.diag_w / acc.probes / acc.delta_sq
    rq = acc.rayleigh / acc.delta_sq
    return {
        "response": response,
        "cache_nmse": acc.delta_sq / acc.cache_sq,
        "kappa": kappa,
        "avg_sensitivity": avg,
        "allocation": weighted_diag / avg if avg > 0 else 0.0,
        "coupling": rq / weighted_diag if weighted_diag != 0 else 0.0,
        "linear_response": kappa * rq,
    }


def probe_sums(fn, zero: torch.Tensor, delta: torch.Tensor, probes: int, gen: torch.Generator) -> dict:
    """JVP sums for the trace, the delta-weighted diagonal and the Rayleigh quotient at ``delta``."""
    w = delta * delta
    trace = diag_w = 0.0
    for _ in range(probes):
        v = torch.randint(0, 2, zero.shape, generator=gen, device=zero.device).to(zero.dtype) * 2 - 1
        jv = jvp(fn, zero, v)
        trace += float(jv.detach().double().pow(2).sum())
        diag_w += float((jvp(fn, zero, v * w).detach().double() * jv.detach().double()).sum())
    rayleigh = float(jvp(fn, zero, delta).detach().double().pow(2).sum())
    return {"trace": trace, "diag_w": diag_w, "rayleigh": rayleigh, "n": zero.numel()}


def nmse_scale(cache_sq: float, raw_sq: float, nmse: float) -> float:
    """The factor that brings a raw perturbation of energy ``raw_sq`` to cache NMSE ``nmse``."""
    if cache_sq <= 0:
        raise ValueError("the cache path is identically zero: its NMSE is undefined")
    if raw_sq <= 0:
        raise ValueError("the perturbation is identically zero (e.g. a quantiser with no error)")
    return (nmse * cache_sq / raw_sq) ** 0.5
