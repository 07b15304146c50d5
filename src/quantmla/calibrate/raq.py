"""RAQ-MLA's transforms (role-aware quantisation): a general invertible ``A`` per cached path, fitted without
gradients against the error that path delivers to the attention output.

* **Latent** ``A_c`` after the norm: the cache stores ``Q(c A_c)``, read back through ``W_UK A_c^-T`` and
  ``W_UV A_c^-T``. Its role metric is the attention-weighted value-readout error: value-readout errors of
  different tokens are nearly uncorrelated (the seed's Figure 9), so
  ``D_c(A) = sum_j w_j e_j M e_j^T`` with ``e_j = Q(c_j A) A^-1 - c_j``, ``M = sum_h W_UV,h^T W_UV,h`` and
  ``w_j = sum_h sum_t p_{h,t,j}^2`` (``p`` the attention probabilities).
* **RoPE key** ``A_R`` after RoPE: the cache stores ``Q(k A_R)``, the query is compensated by ``A_R^-T``. Its
  role metric is the score perturbation ``D_R(A) = sum_{t >= j} (q_t . (Q(k_j A) A^-1 - k_j))^2``.

Fitting (no gradient training), from a randomised Hadamard: a round takes the current codes ``y_j`` of
``Q(x_j A)`` and the orthogonal map that carries the tokens closest to them (weighted Procrustes, the step of
iterative quantisation), ``O = argmin sum_j w_j ||x_j O - y_j||^2`` (token weights ``w_j`` of the role metric;
RoPE: ``w_j = sum_{t >= j} ||q_t||^2``), and moves ``A`` towards it, ``A <- (1 - lambda) A + lambda O``
(a general invertible matrix once damped); or towards the inverse of the read side fitted by weighted least
squares to the codes. Each is rescaled to the Hadamard's Frobenius norm (a per-token quantiser's error does not
depend on the scale of ``A``, up to fp16 metadata, so the scale is held fixed). Each rule and damping ``lambda``
gives a trajectory; the rule, damping and round with the lowest held-out attention-output error is kept
(round 0 is the Hadamard), and, as for every method in quantmla, the original basis (``A = I``) is a candidate
too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantmla.calibrate.methods import ORIGINAL, hadamard
from quantmla.calibrate.objectives import LayerBatch, attention_probs
from quantmla.formats.codec import MAX_CONDITION, PathCodec
from quantmla.formats.scheme import PathFormat
from quantmla.measure.attention import run_attention


@dataclass(frozen=True)
class RaqConfig:
    dampings: tuple[float, ...] = (0.25, 0.5, 1.0)
    rounds: int = 6

    def __post_init__(self) -> None:
        if not self.dampings or any(not 0 < d <= 1 for d in self.dampings) or self.rounds < 0:
            raise ValueError(f"dampings {self.dampings} must lie in (0, 1] and rounds={self.rounds} be >= 0")


@torch.no_grad()
def key_weights(batch: LayerBatch) -> torch.Tensor:
    """``[B, T]``: the attention-weighted value-readout weight of each cached token of ``batch``."""
    return attention_probs(batch)[1].double().pow(2).sum((1, 2))


def query_weights(batch: LayerBatch) -> torch.Tensor:
    """``[B, T]``: ``sum_{t >= j} sum_h ||q_t||^2``, the weight of key ``j`` in the causal score perturbation."""
    q2 = batch.q_pe.double().pow(2).sum((1, 3))  # [B, T]
    return q2.flip(-1).cumsum(-1).flip(-1)


def _read_back(x: torch.Tensor, a: torch.Tensor, fmt: PathFormat, group_size: int) -> torch.Tensor:
    """``Q(x A) A^-1`` in float64 (``x [B, 1, T, d]``, a paged format in pages along T)."""
    y = fmt.fake_quantize((x.double() @ a), group_size)
    return y @ torch.linalg.inv(a)


@torch.no_grad()
def attention_error(batches: list[LayerBatch], path: str, a: torch.Tensor, fmt: PathFormat, group_size: int) -> float:
    """Held-out normalised attention-output error with ``path`` stored as ``Q(x A)`` and read back exactly."""
    num = den = 0.0
    for b in batches:
        x = b.c if path == "content" else b.r
        delta = (_read_back(x, a.to(x.device), fmt, group_size) - x.double()).to(x.dtype)
        out = run_attention(b.call, **{"delta_c" if path == "content" else "delta_r": delta})[0]
        num += float((out - b.out).double().pow(2).sum())
        den += float(b.out.double().pow(2).sum())
    return num / den


@torch.no_grad()
def refit(batches: list[LayerBatch], weights: list[torch.Tensor], path: str, a: torch.Tensor, fmt: PathFormat,
          group_size: int) -> torch.Tensor:  # fmt: skip
    """The orthogonal map that best carries the tokens onto their current codes (weighted Procrustes, the
    iterative-quantisation step): ``argmin_Q sum_j w_j ||x_j Q - c_j||^2`` over orthogonal ``Q``, with ``c_j``
    the read-back of ``Q(x_j A)`` in the stored space."""
    d = a.shape[0]
    cross = torch.zeros(d, d, dtype=torch.float64, device=a.device)
    for b, w in zip(batches, weights, strict=True):
        x = (b.c if path == "content" else b.r).double()
        y = fmt.fake_quantize(x @ a, group_size)[:, 0].reshape(-1, d)
        cross += x[:, 0].reshape(-1, d).T @ (w.reshape(-1, 1).to(a.device) * y)
    u, _, vh = torch.linalg.svd(cross)
    return u @ vh


@torch.no_grad()
def refit_read_side(batches: list[LayerBatch], weights: list[torch.Tensor], path: str, a: torch.Tensor,
                    fmt: PathFormat, group_size: int) -> torch.Tensor:  # fmt: skip
    """``B^-1`` for the read side ``B`` fitted by weighted least squares to the current codes,
    ``B = argmin sum_j w_j ||y_j B - x_j||^2`` (``y_j`` the read-back of ``Q(x_j A)`` in the stored space)."""
    d = a.shape[0]
    yy = torch.zeros(d, d, dtype=torch.float64, device=a.device)
    yx = torch.zeros(d, d, dtype=torch.float64, device=a.device)
    for b, w in zip(batches, weights, strict=True):
        x = (b.c if path == "content" else b.r).double()
        y = fmt.fake_quantize(x @ a, group_size)[:, 0].reshape(-1, d)
        ww = w.reshape(-1, 1).to(a.device)
        yy += y.T @ (ww * y)
        yx += y.T @ (ww * x[:, 0].reshape(-1, d))
    ridge = 1e-9 * yy.diagonal().mean().clamp_min(1e-30) * torch.eye(d, dtype=torch.float64, device=a.device)
    return torch.linalg.inv(torch.linalg.solve(yy + ridge, yx))


#: the update rules of the trajectories: towards the Procrustes map onto the codes, or towards the inverse of
#: the least-squares read side
RULES = {"procrustes": refit, "least-squares": refit_read_side}


def fit_path(
    path: str, train: list[LayerBatch], val: list[LayerBatch], fmt: PathFormat, group_size: int, cfg: RaqConfig,
    gen: torch.Generator,
) -> tuple[PathCodec, dict]:  # fmt: skip
    """RAQ-MLA's transform of one path of one layer and its report (held-out errors, chosen damping and round)."""
    x0 = train[0].c if path == "content" else train[0].r
    d, dev = x0.shape[-1], x0.device
    eye = torch.eye(d, dtype=torch.float64, device=dev)
    weights = [key_weights(b) if path == "content" else query_weights(b) for b in train]
    vals = {ORIGINAL: attention_error(val, path, eye, fmt, group_size)}
    if d & (d - 1):
        info = {"init": ORIGINAL, "candidate_val": vals, "val_before": vals[ORIGINAL], "val_after": vals[ORIGINAL]}
        return PathCodec(fmt), {**info, "note": f"no Hadamard start for d={d} (not a power of two)"}
    h = hadamard(d, gen).to(dev)
    vals["hadamard"] = attention_error(val, path, h, fmt, group_size)
    best = (vals["hadamard"], "hadamard", h, 0.0, 0)
    trajectories = {}
    for rule, step in RULES.items():
        for lam in cfg.dampings:
            a, curve = h.clone(), [vals["hadamard"]]
            for r in range(1, cfg.rounds + 1):
                try:
                    nxt = (1 - lam) * a + lam * step(train, weights, path, a, fmt, group_size)
                except RuntimeError:  # singular normal equations: the trajectory ends
                    break
                nxt = nxt * (math.sqrt(d) / nxt.norm())  # the scale of A is free (per-token ranges): |A|_F = |H|_F
                if not float(torch.linalg.cond(nxt)) < MAX_CONDITION:
                    break
                a = nxt
                try:
                    v = attention_error(val, path, a, fmt, group_size)
                except ValueError:  # beyond the fp16 range of the metadata: the trajectory ends
                    break
                curve.append(v)
                if v < best[0]:
                    best = (v, f"{rule}, damping {lam:g}, round {r}", a.clone(), lam, r)
            trajectories[f"{rule} {lam:g}"] = curve
    info = {"candidate_val": vals, "trajectories": trajectories, "val_before": vals[ORIGINAL]}
    if vals[ORIGINAL] <= best[0]:
        return PathCodec(fmt), {**info, "init": ORIGINAL, "val_after": vals[ORIGINAL]}
    info.update(init=best[1], damping=best[3], round=best[4], val_after=best[0])
    return PathCodec(fmt, transform=best[2].cpu()), info
