"""RoLaQ (rotation-calibrated latent quantisation): a rotation refined within the subspaces of the frozen key and
value projections, and learned quantisation ranges, for a low-bit latent.

* **Rotation** of the normalised latent ``n = c / g`` (the gain folded into ``kv_b_proj``, as QuaRot does), so it
  fuses into the weights like every quantmla content transform (:class:`~quantmla.transforms.ContentTransform`
  with ``S = 1``): the cache is ``n R``. ``R = Q blockdiag(exp(A_b - A_b^T)) Q^T R_0``: ``R_0`` a randomised
  Hadamard, ``Q`` the eigenvectors of ``K^T K / |K|^2 + V^T V / |V|^2`` (``K``, ``V``: every head's key and value
  up-projection acting on ``n``, i.e. ``W_UK diag(g)``, ``W_UV diag(g)``) ordered by eigenvalue and cut into
  blocks of 64, so a learned ``A_b`` mixes only directions the projections weigh alike.
* **Learned ranges** (:mod:`~quantmla.quant.ranged`): per group of the cached latent a threshold ratio and a
  reconstruction gain, written with each token; the storage is the plain affine format's.
* **Training**, weights frozen: Adam on the block rotations, ratios and gains against the attention-output error
  of the layer (straight-through rounding) plus a prediction-matching term, the mean KL of the layer's own
  attention probabilities with the quantised latent from the clean ones; best step on held-out data. The
  original basis with unit ranges (RTN) and the Hadamard start are candidates too.
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.calibrate.methods import ORIGINAL, LearnConfig, hadamard, learn, mean_layer_loss
from quantmla.calibrate.objectives import LayerBatch, attention_probs
from quantmla.formats.scheme import PathFormat
from quantmla.models.adapter import MLAAdapter
from quantmla.quant.ranged import ste_ranged
from quantmla.transforms.fuse import ContentTransform, polar_factor

BLOCK = 64  # eigen-directions per refined block
KL_WEIGHT = 1.0  # weight of the prediction-matching term


def projection_basis(adapter: MLAAdapter, attn: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """``[d, d]`` float64: the eigenvectors (columns, largest first) of the normalised key and value metrics on
    the pre-gain latent."""
    k = adapter.w_uk(attn).detach().double().reshape(-1, g.shape[0]) * g.to(torch.float64)
    v = adapter.w_uv(attn).detach().double().reshape(-1, g.shape[0]) * g.to(torch.float64)
    p = k.T @ k / k.pow(2).sum() + v.T @ v / v.pow(2).sum()
    _, vecs = torch.linalg.eigh(p.cpu())
    return vecs.flip(-1)


class RolaqParam(nn.Module):
    """``R = Q blockdiag(exp(A_b - A_b^T)) Q^T R_0``, ratios ``sigmoid(a)``, gains ``exp(u)``."""

    def __init__(self, r0: torch.Tensor, scales: torch.Tensor, basis: torch.Tensor, groups: int,
                 learn_rotation: bool = True) -> None:  # fmt: skip
        super().__init__()
        d = r0.shape[0]
        nb = d // BLOCK if d % BLOCK == 0 else 0
        self.register_buffer("r0", r0.double().clone())
        self.register_buffer("scales", scales.double().clone())  # fixed: S of the fused transform
        self.register_buffer("basis", basis.double().clone())
        self.skew = nn.Parameter(torch.zeros(nb, BLOCK, BLOCK, dtype=torch.float64), requires_grad=learn_rotation)
        self.logit = nn.Parameter(torch.full((groups,), 4.0, dtype=torch.float64))  # ratio 0.982
        self.log_gain = nn.Parameter(torch.zeros(groups, dtype=torch.float64))

    def rotation(self) -> torch.Tensor:
        if self.skew.shape[0] == 0:
            return self.r0
        blocks = torch.matrix_exp(self.skew - self.skew.transpose(-1, -2))
        inner = torch.block_diag(*blocks)
        return self.basis @ inner @ self.basis.T @ self.r0

    def ratios(self) -> torch.Tensor:
        return torch.sigmoid(self.logit)

    def gains(self) -> torch.Tensor:
        return torch.exp(self.log_gain)


def rolaq_loss(batch: LayerBatch, clean_probs: torch.Tensor, g: torch.Tensor, p: RolaqParam, fmt: PathFormat,
               group_size: int) -> torch.Tensor:  # fmt: skip
    """Normalised attention-output error plus ``KL_WEIGHT`` x the mean KL of the attention probabilities, with the
    latent stored as ``Q((c / g) R S)`` under learned ranges (straight-through) and read back."""
    c = batch.c
    dt = c.dtype
    r = p.rotation().to(c.device, dt)
    gd, sc = g.to(c.device, dt), p.scales.to(c.device, dt)
    y = ((c / gd) @ r) * sc
    y_hat = ste_ranged(y, fmt.bits, fmt.group_size(group_size), p.ratios(), p.gains())
    c_hat = ((y_hat / sc) @ r.T) * gd
    out, probs = attention_probs(batch, c_hat - c)
    err = (out - batch.out).pow(2).sum() / batch.out.pow(2).sum()
    p, q = clean_probs.clamp_min(1e-30), probs.clamp_min(1e-30)
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    return err + KL_WEIGHT * kl


def fit_layer(train: list[LayerBatch], val: list[LayerBatch], adapter: MLAAdapter, attn: nn.Module, g: torch.Tensor,
              fmt: PathFormat, group_size: int, cfg: LearnConfig, gen: torch.Generator):  # fmt: skip
    """``(fused content transform, ratios, gains, report)`` of one layer."""
    d = g.shape[0]
    groups = d // fmt.group_size(group_size)
    dev = train[0].c.device
    g = g.to(dev)
    clean = {id(b): attention_probs(b)[1].detach() for b in train + val}
    basis = projection_basis(adapter, attn, g)
    ones = torch.ones(d, dtype=torch.float64)
    # the original basis (R = sign g, S = |g|: the cache c itself, RTN) and the Hadamard of the unit-gain latent
    starts = {ORIGINAL: (torch.diag(torch.sign(g.double().cpu())), g.double().abs().cpu())}
    if not d & (d - 1):
        starts["hadamard"] = (hadamard(d, gen), ones)
    vals, params = {}, {}
    for name, (r0, s0) in starts.items():
        p = RolaqParam(r0, s0, basis, groups, learn_rotation=name != ORIGINAL).to(dev)
        with torch.no_grad():
            p.logit.fill_(30.0)  # unit ratios: the plain grid
        params[name] = p
        vals[name] = mean_layer_loss(lambda b, p=p: rolaq_loss(b, clean[id(b)], g, p, fmt, group_size), val)
    init = min(vals, key=vals.get)
    p = params[init]
    with torch.no_grad():
        p.logit.fill_(4.0)  # ratios 0.982: every ratio has a gradient
    v, step = learn(p, lambda b: rolaq_loss(b, clean[id(b)], g, p, fmt, group_size), train, val, cfg)
    info = {"candidate_val": vals, "init": init, "val_before": vals[ORIGINAL], "best_step": step}
    if vals[init] <= v:  # the start with unit ranges validates best
        r, ratios, gains = p.r0, torch.ones(groups, dtype=torch.float64), torch.ones(groups, dtype=torch.float64)
        info["val_after"] = vals[init]
    else:
        with torch.no_grad():
            r, ratios, gains = p.rotation(), p.ratios(), p.gains()
        info["val_after"] = v
    if init == ORIGINAL:  # the rotation is not learned there: kept exactly (it fuses to the identity)
        rot = p.r0.cpu()
    else:
        rot = polar_factor(r.detach().double().cpu())  # re-orthogonalised (matrix_exp's rounding)
    info["ratios"], info["gains"] = ratios.detach().cpu().tolist(), gains.detach().cpu().tolist()
    return ContentTransform(rot, p.scales.cpu()), ratios.detach().cpu(), gains.detach().cpu(), info
