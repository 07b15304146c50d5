"""Per-layer transforms of each method, all in the fusable spaces of :mod:`quantmla.transforms`.

* ``rtn``: no transform;
* ``smoothquant``: per-channel content scales and per-pair RoPE scales that flatten the ranges
  (``s_j = (m / max|c_j|)^alpha``, ``m`` their geometric mean, alpha 0.5);
* ``quarot``: a randomised Hadamard rotation of the content latent; on the RoPE path the randomised
  Hadamard that commutes with RoPE, a 2x2 Hadamard per pair (rotation by +-pi/4);
* ``quantmla``: learned R, S (content; R0 exp(A - A^T)) and phi, sigma (RoPE) against the
  function-aligned objectives, best step on held-out data. Every baseline's transform is a
  candidate start (content: identity, the SmoothQuant scales, a randomised Hadamard; RoPE:
  identity, the SmoothQuant pair scales, the QuaRot pair rotations); the one that validates best is
  trained. Step 0 counts, so on held-out data QuantMLA's layer objective is never worse than a
  baseline's. The candidates are returned (``info["candidates"]``) for the model-level stage
  (:mod:`quantmla.calibrate.model_level`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quantmla.calibrate.objectives import LayerBatch, content_loss, rope_loss
from quantmla.quant.scheme import PathFormat
from quantmla.transforms.fuse import ContentTransform, RopeTransform

METHODS = ("rtn", "smoothquant", "quarot", "quantmla")


def hadamard(d: int, generator: torch.Generator) -> torch.Tensor:
    """Randomised Hadamard ``H diag(+-1) / sqrt(d)`` (Sylvester; ``d`` a power of two)."""
    if d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two dimension, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=generator).double() * 2 - 1
    return h * signs / math.sqrt(d)


def smooth_scales(amax: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    amax = amax.clamp_min(1e-8)
    return torch.exp(alpha * (amax.log().mean() - amax.log()))


@dataclass(frozen=True)
class LearnConfig:
    steps: int = 300
    lr: float = 5e-3
    eval_every: int = 25

    def __post_init__(self) -> None:
        if self.steps < 0 or self.lr <= 0 or self.eval_every < 1:
            raise ValueError(f"steps={self.steps}, lr={self.lr}, eval_every={self.eval_every} out of range")


class ContentParam(nn.Module):
    def __init__(self, r0: torch.Tensor, s0: torch.Tensor | None = None) -> None:
        super().__init__()
        d = r0.shape[0]
        self.register_buffer("r0", r0)
        self.skew = nn.Parameter(torch.zeros(d, d, dtype=torch.float64))
        log_s = torch.zeros(d, dtype=torch.float64) if s0 is None else s0.double().log()
        self.log_s = nn.Parameter(log_s)

    def rotation(self) -> torch.Tensor:
        return self.r0 @ torch.matrix_exp(self.skew - self.skew.T)

    def scales(self) -> torch.Tensor:
        return torch.exp(self.log_s)

    @torch.no_grad()
    def set_(self, t: ContentTransform) -> None:
        self.r0.copy_(t.rotation)
        self.skew.zero_()
        self.log_s.copy_(t.scales.double().log())

    @torch.no_grad()
    def transform(self) -> ContentTransform:
        """The current transform; matrix_exp's rounding is removed by re-orthogonalising (polar factor)."""
        u, _, vh = torch.linalg.svd(self.rotation())
        return ContentTransform(u @ vh, self.scales().clone())


class RopeParam(nn.Module):
    def __init__(self, pairs: int, pair_index: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("pair_index", pair_index)
        self.angles = nn.Parameter(torch.zeros(pairs, dtype=torch.float64))
        self.log_scales = nn.Parameter(torch.zeros(pairs, dtype=torch.float64))

    def transform(self) -> RopeTransform:
        return RopeTransform(self.angles, self.log_scales)

    @torch.no_grad()
    def set_(self, t: RopeTransform) -> None:
        self.angles.copy_(t.angles)
        self.log_scales.copy_(t.log_scales)

    @torch.no_grad()
    def snapshot(self) -> RopeTransform:
        return RopeTransform(self.angles.clone(), self.log_scales.clone())


def _mean_loss(fn, batches: list[LayerBatch]) -> float:
    with torch.no_grad():
        return sum(float(fn(b)) for b in batches) / len(batches)


def learn(param: nn.Module, loss_fn, train: list[LayerBatch], val: list[LayerBatch], cfg: LearnConfig):
    """Adam on ``param``; returns (best validation loss, its step, the parameters at that step)."""
    opt = torch.optim.Adam(param.parameters(), lr=cfg.lr)
    best = (_mean_loss(loss_fn, val), 0, {k: v.detach().clone() for k, v in param.state_dict().items()})
    for step in range(1, cfg.steps + 1):
        loss = loss_fn(train[(step - 1) % len(train)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            v = _mean_loss(loss_fn, val)
            if v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in param.state_dict().items()})
    param.load_state_dict(best[2])
    return best[0], best[1]


def content_transform(
    method: str, train, val, g, fmt: PathFormat, group_size: int, cfg: LearnConfig, gen: torch.Generator
) -> tuple[ContentTransform, dict]:
    d = g.shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    ones = torch.ones(d, dtype=torch.float64)

    def loss_of(rot, sc):
        return lambda b: content_loss(
            b, g, rot() if callable(rot) else rot, sc() if callable(sc) else sc, fmt, group_size
        )

    base = _mean_loss(loss_of(eye, ones), val)
    if method == "rtn":
        return ContentTransform(eye, ones), {"val_before": base, "val_after": base}
    amax = torch.stack([(b.c[:, 0].double() / g).abs().amax((0, 1)) for b in train]).amax(0).cpu()
    smooth = smooth_scales(amax)
    if method == "smoothquant":
        return ContentTransform(eye, smooth), {"val_before": base, "val_after": _mean_loss(loss_of(eye, smooth), val)}
    # one draw of the randomised Hadamard, shared by QuaRot and QuantMLA's Hadamard start point
    h = hadamard(d, gen) if not d & (d - 1) else None
    if method == "quarot":
        if h is None:
            raise ValueError(f"quarot needs a power-of-two latent dimension, got {d}")
        return ContentTransform(h, ones), {"val_before": base, "val_after": _mean_loss(loss_of(h, ones), val)}
    if method != "quantmla":
        raise ValueError(f"method={method!r}; valid: {METHODS}")
    candidates = [("identity", eye, None), ("smooth", eye, smooth)]
    if h is not None:
        candidates.append(("hadamard", h, None))
    # the start that validates best is the one trained (training every start costs 3x, for little)
    init, r0, s0 = min(candidates, key=lambda c: _mean_loss(loss_of(c[1], ones if c[2] is None else c[2]), val))
    p = ContentParam(r0, s0)
    v, step = learn(p, loss_of(p.rotation, p.scales), train, val, cfg)
    info = {"val_before": base, "val_after": v, "best_step": step, "init": init}
    info["candidates"] = {name: ContentTransform(r, ones if s is None else s) for name, r, s in candidates}
    return p.transform(), info


def rope_transform(
    method: str,
    train,
    val,
    pairs: torch.Tensor,
    fmt: PathFormat,
    group_size: int,
    cfg: LearnConfig,
    gen: torch.Generator,
) -> tuple[RopeTransform, dict]:
    n = pairs.shape[0]
    zeros = torch.zeros(n, dtype=torch.float64)

    def loss_of(t: RopeTransform):
        return lambda b: rope_loss(b, t.matrix(pairs), t.inverse_matrix(pairs), fmt, group_size)

    ident = RopeTransform(zeros, zeros)
    base = _mean_loss(loss_of(ident), val)
    if method == "rtn":
        return ident, {"val_before": base, "val_after": base}
    norms = torch.stack([b.r[:, 0].double()[..., pairs.to(b.r.device)].norm(dim=-1).amax((0, 1)) for b in train])
    smooth = RopeTransform(zeros, smooth_scales(norms.amax(0).cpu()).log())
    if method == "smoothquant":
        return smooth, {"val_before": base, "val_after": _mean_loss(loss_of(smooth), val)}
    signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    quarot = RopeTransform(signs * math.pi / 4, zeros)
    if method == "quarot":
        return quarot, {"val_before": base, "val_after": _mean_loss(loss_of(quarot), val)}
    if method != "quantmla":
        raise ValueError(f"method={method!r}; valid: {METHODS}")
    starts = (("identity", ident), ("smooth", smooth), ("quarot", quarot))
    init, start = min(starts, key=lambda c: _mean_loss(loss_of(c[1]), val))  # the best start is trained
    p = RopeParam(n, pairs)
    p.set_(start)

    def live(b):
        t = p.transform()
        return rope_loss(b, t.matrix(pairs), t.inverse_matrix(pairs), fmt, group_size)

    v, step = learn(p, live, train, val, cfg)
    t = p.snapshot()
    info = {"val_before": base, "val_after": v, "best_step": step, "init": init, "candidates": dict(starts)}
    return t, info
