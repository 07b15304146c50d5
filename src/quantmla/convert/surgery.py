"""The conversion's algebra, float64, one layer at a time: calibrated KNorm folded into W_k, the RoPE pairs each
KV head keeps, and the latent factorisation of [W_k,nope; W_v].

The result, :class:`LatentLayer`, is MHA2MLA's form: each KV head keeps its own RoPE pairs (at their original
frequencies) and one latent per token holds the keys' NoPE part and the values of every KV head. At full rank
with every pair kept it is the source attention exactly (with k_norm replaced by its calibrated constant)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.convert.config import ConvertConfig
from quantmla.convert.source import SourceAttention, SourceShape
from quantmla.convert.stats import LayerStats


@dataclass
class LatentLayer:
    """One converted attention layer (float64). Rows of ``wq`` as the source's; ``pairs[g]`` the pair indices KV
    head ``g`` keeps (ascending), each rotating at its source frequency ``theta^(-2k/d)``."""

    wq: torch.Tensor  # (heads * d, hidden)
    bq: torch.Tensor | None
    q_gain: torch.Tensor | None  # dynamic q_norm gain (d,)
    eps: float
    pairs: torch.Tensor  # (kv, r) long
    wkr: torch.Tensor  # (kv, 2r, n): RoPE key rows, rotate-half order within the kept pairs; n = hidden (+1)
    down: torch.Tensor  # (latent, n)
    up_k: torch.Tensor  # (kv, d - 2r, latent)
    up_v: torch.Tensor  # (kv, d, latent)
    knorm_scale: torch.Tensor | None  # (kv,) the fitted constants (reported)
    biased: bool  # n = hidden + 1: the last input column is the constant 1 (the keys' and values' biases)

    @property
    def rope_pairs(self) -> int:
        return self.pairs.shape[1]

    @property
    def latent_rank(self) -> int:
        return self.down.shape[0]


def rope_dims(pairs: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope, nope)`` dimension indices of a head for kept ``pairs`` (1-D): rope in rotate-half order (first
    halves of the kept pairs, then their second halves), nope ascending."""
    half = head_dim // 2
    rope = torch.cat([pairs, pairs + half])
    keep = torch.ones(head_dim, dtype=torch.bool)
    keep[rope] = False
    return rope, torch.arange(head_dim)[keep]


def choose_pairs(cfg: ConvertConfig, shape: SourceShape, stats: LayerStats) -> torch.Tensor:
    """``(kv, r)`` kept pair indices: every c-th pair from 0 (uniform) or the top-r of
    ``E||k_pair|| * sum over the group's query heads of E||q_pair||`` per KV head (contribution)."""
    pairs, r, kv = shape.head_dim // 2, cfg.rope_pairs, shape.num_kv_heads
    if cfg.rope == "uniform":
        return torch.arange(0, pairs, pairs // r)[:r].repeat(kv, 1)
    q = stats.mean_q_pair().view(kv, shape.group, pairs).sum(1)
    score = q * stats.mean_k_pair()
    return torch.topk(score, r, dim=1).indices.sort(dim=1).values


def fold_knorm(cfg: ConvertConfig, shape: SourceShape, src: SourceAttention, stats: LayerStats):
    """``(wk, bk, scale)``: k_norm's gain and (calibrated) constant folded into the key rows, per KV head."""
    if src.k_gain is None:
        return src.wk, src.bk, None
    kv, d = shape.num_kv_heads, shape.head_dim
    scale = stats.knorm_scale() if cfg.knorm == "calibrated" else torch.ones(kv, dtype=torch.float64)
    rows = (src.k_gain[None, :] * scale[:, None]).reshape(kv * d)
    bk = None if src.bk is None else src.bk * rows
    return src.wk * rows[:, None], bk, scale


def _augment(w: torch.Tensor, b: torch.Tensor | None, biased: bool) -> torch.Tensor:
    if not biased:
        return w
    return torch.cat([w, (b if b is not None else torch.zeros(len(w), dtype=w.dtype))[:, None]], 1)


def _roots(m: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m^(1/2), m^(-1/2))`` of a PSD matrix damped by ``damping`` of its mean diagonal."""
    m = m + damping * m.diagonal().mean() * torch.eye(len(m), dtype=m.dtype)
    lam, u = torch.linalg.eigh(m)
    lam = lam.clamp_min(torch.finfo(lam.dtype).tiny)
    return (u * lam.sqrt()) @ u.T, (u / lam.sqrt()) @ u.T


def factorise(w: torch.Tensor, rank: int, moment: torch.Tensor | None, damping: float,
              left: torch.Tensor | None = None):  # fmt: skip
    """``(up, down)`` with ``up @ down`` the rank-``rank`` approximation of ``w`` (rows x n) that minimises
    ``E[e^T left e]`` for the output error ``e = (w - up down) x`` under the input second moment ``moment`` (both
    damped by ``damping`` of their mean diagonal; ``left`` None: the identity), or ``||w - up down||_F`` without a
    moment. Both factors carry the square root of the singular values."""
    if moment is None:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        root = s[:rank].sqrt()
        return u[:, :rank] * root, root[:, None] * vh[:rank]
    right, right_inv = _roots(moment, damping)
    left_root, left_inv = (None, None) if left is None else _roots(left, damping)
    a = w @ right if left is None else left_root @ w @ right
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    root = s[:rank].sqrt()
    up = u[:, :rank] * root
    return (up if left is None else left_inv @ up), (root[:, None] * vh[:rank]) @ right_inv


def output_metric(shape: SourceShape, src: SourceAttention, stats: LayerStats, pairs: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(keys, values)`` block-diagonal metrics of the ``functional`` factorisation: a NoPE key row error ``e`` of
    KV head ``g`` costs ``e^T (sum over g's query heads of E[q q^T]) e / d`` (its score error, NoPE dims); a value
    error ``e`` costs ``|W_o,h e|^2`` summed over ``g``'s query heads (its output error)."""
    d, g = shape.head_dim, shape.group
    qm = stats.query_moment()
    wo = src.wo.view(shape.hidden_size, shape.num_heads, d)
    keys, values = [], []
    for kv in range(shape.num_kv_heads):
        _, nope = rope_dims(pairs[kv], d)
        keys.append(qm[kv * g : (kv + 1) * g].sum(0)[nope][:, nope] / d)
        block = wo[:, kv * g : (kv + 1) * g]
        values.append(torch.einsum("ohd,ohe->de", block, block))
    return torch.block_diag(*keys), torch.block_diag(*values)


def convert_layer(cfg: ConvertConfig, shape: SourceShape, src: SourceAttention, stats: LayerStats) -> LatentLayer:
    """One layer's :class:`LatentLayer` from its source weights and calibration statistics."""
    kv, d, r = shape.num_kv_heads, shape.head_dim, cfg.rope_pairs
    biased = src.has_kv_bias
    wk, bk, kscale = fold_knorm(cfg, shape, src, stats)
    wk_aug = _augment(wk, bk, biased).view(kv, d, -1)
    wv_aug = _augment(src.wv, src.bv, biased).view(kv, d, -1)
    pairs = choose_pairs(cfg, shape, stats)
    wkr, knope = [], []
    for g in range(kv):
        rope, nope = rope_dims(pairs[g], d)
        wkr.append(wk_aug[g, rope])
        knope.append(wk_aug[g, nope])
    wk_nope = torch.cat(knope)  # (kv (d - 2r), n)
    wv_all = wv_aug.reshape(kv * d, -1)
    moment = stats.second_moment if cfg.svd in ("activation", "functional") else None
    lk, lv = output_metric(shape, src, stats, pairs) if cfg.svd == "functional" else (None, None)
    if cfg.latent == "joint":
        left = None if lk is None else torch.block_diag(lk, lv)
        up, down = factorise(torch.cat([wk_nope, wv_all]), cfg.latent_rank, moment, cfg.damping, left)
        up_k, up_v = up[: len(wk_nope)], up[len(wk_nope) :]
    else:
        half = cfg.latent_rank // 2
        uk, dk = factorise(wk_nope, half, moment, cfg.damping, lk)
        uv, dv = factorise(wv_all, half, moment, cfg.damping, lv)
        down = torch.cat([dk, dv])
        up_k = torch.cat([uk, torch.zeros(len(uk), half, dtype=uk.dtype)], 1)
        up_v = torch.cat([torch.zeros(len(uv), half, dtype=uv.dtype), uv], 1)
    rank = down.shape[0]
    return LatentLayer(
        wq=src.wq,
        bq=src.bq,
        q_gain=src.q_gain,
        eps=src.eps,
        pairs=pairs,
        wkr=torch.stack(wkr),
        down=down,
        up_k=up_k.reshape(kv, d - 2 * r, rank),
        up_v=up_v.reshape(kv, d, rank),
        knorm_scale=kscale,
        biased=biased,
    )
