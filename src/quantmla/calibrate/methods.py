"""Per-layer transforms of each method, all in the fusable spaces of :mod:`quantmla.transforms`.

The fused model caches ``c diag(g)^-1 R S`` (``g`` the ``kv_a_layernorm`` gain). The *original-basis
identity* (``R = diag(sign g)``, ``S = |g|``) makes that ``c`` itself, the untouched model's cache:
it is RTN, and it is a candidate of every method, so that on held-out data no method's layer
objective is worse than plain RTN. Per layer and path the held-out objective picks between the
method's transform and the original-basis identity (``info["init"]`` names the one chosen,
``info["candidate_val"]`` holds every candidate's held-out value):

* ``rtn``: the original-basis identity (:func:`quantmla.calibrate.calibrate_model` fuses nothing);
* ``smoothquant``: per-channel content scales that flatten the ranges of the cached ``c`` in the
  original basis, ``S = |g| smooth_scales(amax|c|)`` with ``s_j = (m / max|c_j|)^alpha`` (``m`` their
  geometric mean, alpha 0.5). SmoothQuant never divides a norm gain out, so the scales act on ``c``
  as the model caches it. On the RoPE path the same per-pair scales of the key's pair norms;
* ``quarot``: a randomised Hadamard rotation of the *normalised, pre-gain* latent ``c / g``
  (``R = H``, ``S = 1``), the gain folded into ``kv_b_proj``: QuaRot folds every norm's gain into the
  next weight and rotates the normalised vector, which is what this does. On the RoPE path the
  randomised Hadamard that commutes with RoPE, a 2x2 Hadamard per pair (rotation by +-pi/4);
* ``quantmla``: learned R, S (content; R0 exp(A - A^T)) and phi, sigma (RoPE) against the
  function-aligned objectives, best step on held-out data. Its start points are the
  original-basis identity (``original``), the unit-gain identity (``unit-gain``: ``R = I``,
  ``S = 1``, the cache ``c / g``), the SmoothQuant scales (``smooth``) and the randomised Hadamard
  (``hadamard``); RoPE: the identity (``original``), the SmoothQuant pair scales and the QuaRot pair
  rotations. The one that validates best is trained; step 0 counts, so on held-out data QuantMLA's
  layer objective is never worse than RTN's or a baseline's. The candidates are returned
  (``info["candidates"]``) for the model-level stage (:mod:`quantmla.calibrate.model_level`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from quantmla.calibrate.objectives import LayerBatch, content_loss, rope_loss
from quantmla.formats.export import METHODS
from quantmla.formats.scheme import PathFormat
from quantmla.transforms.fuse import ContentTransform, RopeTransform, original_basis, polar_factor

logger = logging.getLogger(__name__)
ORIGINAL = "original"  # the candidate name of the original-basis identity (RTN)
_LOGGED: set[tuple] = set()


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
    """``R = R0 exp(A - A^T)``, ``s = s0 exp(u)``; at ``A = 0``, ``u = 0`` exactly the start ``(R0, s0)``."""

    def __init__(self, r0: torch.Tensor, s0: torch.Tensor | None = None) -> None:
        super().__init__()
        d = r0.shape[0]
        self.register_buffer("r0", r0.double().clone())
        self.register_buffer("s0", torch.ones(d, dtype=torch.float64) if s0 is None else s0.double().clone())
        self.skew = nn.Parameter(torch.zeros(d, d, dtype=torch.float64))
        self.log_ds = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def rotation(self) -> torch.Tensor:
        return self.r0 @ torch.matrix_exp(self.skew - self.skew.T)

    def scales(self) -> torch.Tensor:
        return self.s0 * torch.exp(self.log_ds)

    @torch.no_grad()
    def set_(self, t: ContentTransform) -> None:
        self.r0.copy_(t.rotation)
        self.s0.copy_(t.scales)
        self.skew.zero_()
        self.log_ds.zero_()

    @torch.no_grad()
    def transform(self) -> ContentTransform:
        """The current transform; matrix_exp's rounding is removed by re-orthogonalising (polar factor)."""
        return ContentTransform(polar_factor(self.rotation()), self.scales().clone())


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


def mean_layer_loss(fn, batches: list[LayerBatch]) -> float:
    """The mean of a layer objective ``fn(batch)`` over ``batches``, without gradients."""
    with torch.no_grad():
        return sum(float(fn(b)) for b in batches) / len(batches)


def learn(
    param: nn.Module,
    loss_fn,
    train: list[LayerBatch],
    val: list[LayerBatch],
    cfg: LearnConfig,
    start_val: float | None = None,
):
    """Adam on ``param``; returns (best validation loss, its step); ``param`` is left at that step.

    ``start_val``: the held-out loss of the start, if already known (step 0 counts with that value).
    """
    opt = torch.optim.Adam(param.parameters(), lr=cfg.lr)
    v0 = mean_layer_loss(loss_fn, val) if start_val is None else start_val
    best = (v0, 0, {k: v.detach().clone() for k, v in param.state_dict().items()})
    for step in range(1, cfg.steps + 1):
        loss = loss_fn(train[(step - 1) % len(train)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            v = mean_layer_loss(loss_fn, val)
            if v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in param.state_dict().items()})
    param.load_state_dict(best[2])
    return best[0], best[1]


def _pick(vals: dict[str, float]) -> str:
    """The candidate with the lowest held-out value; a tie goes to the earlier one (``original`` first)."""
    return min(vals, key=vals.get)


def content_transform(
    method: str, train, val, g, fmt: PathFormat, group_size: int, cfg: LearnConfig, gen: torch.Generator
) -> tuple[ContentTransform, dict]:
    """The content transform of ``method`` for one layer, and its report (held-out values, choice)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}; valid: {', '.join(METHODS)}")
    d = g.shape[0]
    orig = original_basis(g)
    cands = {ORIGINAL: orig}
    if method in ("smoothquant", "quantmla"):
        amax = torch.stack([b.c[:, 0].double().abs().amax((0, 1)) for b in train]).amax(0).cpu()
        cands["smooth"] = ContentTransform(orig.rotation, orig.scales * smooth_scales(amax))
    if method in ("quarot", "quantmla"):
        # one draw of the randomised Hadamard, shared by QuaRot and QuantMLA's Hadamard start point
        if not d & (d - 1):
            cands["hadamard"] = ContentTransform(hadamard(d, gen), torch.ones(d, dtype=torch.float64))
        elif method == "quarot":
            raise ValueError(f"quarot needs a power-of-two latent dimension, got {d}")
        elif ("hadamard", d) not in _LOGGED:
            _LOGGED.add(("hadamard", d))
            logger.info("QuantMLA: no Hadamard start point (latent dimension %d is not a power of two)", d)
    if method == "quantmla":
        cands["unit-gain"] = ContentTransform(torch.eye(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64))

    def loss_of(t: ContentTransform):
        return lambda b: content_loss(b, g, t.rotation, t.scales, fmt, group_size)

    vals = {name: mean_layer_loss(loss_of(t), val) for name, t in cands.items()}
    init = _pick(vals)
    info = {"val_before": vals[ORIGINAL], "init": init, "candidate_val": vals}
    if method != "quantmla":
        return cands[init], {**info, "val_after": vals[init]}
    dev = train[0].c.device  # learn where the batches are (CPU parameters would cost a round trip a step)
    p = ContentParam(cands[init].rotation, cands[init].scales).to(dev)
    g_dev = g.to(dev)
    v, step = learn(
        p, lambda b: content_loss(b, g_dev, p.rotation(), p.scales(), fmt, group_size), train, val, cfg, vals[init]
    )
    info.update(val_after=v, best_step=step, candidates=cands)
    if step == 0:
        return cands[init], info
    t = p.transform()
    return ContentTransform(t.rotation.cpu(), t.scales.cpu()), info


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
    """The RoPE transform of ``method`` for one layer (the identity is the original basis here)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}; valid: {', '.join(METHODS)}")
    n = pairs.shape[0]
    zeros = torch.zeros(n, dtype=torch.float64)
    cands = {ORIGINAL: RopeTransform(zeros, zeros.clone())}
    if method in ("smoothquant", "quantmla"):
        norms = torch.stack([b.r[:, 0].double()[..., pairs.to(b.r.device)].norm(dim=-1).amax((0, 1)) for b in train])
        cands["smooth"] = RopeTransform(zeros.clone(), smooth_scales(norms.amax(0).cpu()).log())
    if method in ("quarot", "quantmla"):
        signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        cands["quarot"] = RopeTransform(signs * math.pi / 4, zeros.clone())

    def loss_of(t: RopeTransform):
        return lambda b: rope_loss(b, t.matrix(pairs), t.inverse_matrix(pairs), fmt, group_size)

    vals = {name: mean_layer_loss(loss_of(t), val) for name, t in cands.items()}
    init = _pick(vals)
    info = {"val_before": vals[ORIGINAL], "init": init, "candidate_val": vals}
    if method != "quantmla":
        return cands[init], {**info, "val_after": vals[init]}
    dev = train[0].r.device
    pairs_dev = pairs.to(dev)
    p = RopeParam(n, pairs_dev).to(dev)
    p.set_(cands[init])

    def live(b):
        t = p.transform()
        return rope_loss(b, t.matrix(pairs_dev), t.inverse_matrix(pairs_dev), fmt, group_size)

    v, step = learn(p, live, train, val, cfg, vals[init])
    info.update(val_after=v, best_step=step, candidates=cands)
    if step == 0:
        return cands[init], info
    t = p.snapshot()
    return RopeTransform(t.angles.cpu(), t.log_scales.cpu()), info
