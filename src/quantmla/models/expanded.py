"""MLA attention in the expanded form, for many queries at once (prefills, whole-sequence evaluation).

The absorbed form (:func:`quantmla.models.latent.absorbed_attention`) scores each (query, key) pair over
``d_c + d_r`` dims and sums values over ``d_c``: the right form for a decode step, which reads the cached
latent once. For S queries over L keys, expanding the latent per head first (``k = W_UK c``, ``v = W_UV c``)
costs ``L * H * (d_n + d_v) * d_c`` once and then ``d_n + d_r`` and ``d_v`` per pair: the same scores and
outputs (the same sums, in another order), and far less work once S is more than a few dozen. The pairs go
through ``scaled_dot_product_attention``, so no ``L x L`` score matrix is materialised where a fused kernel
runs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def expand_latent(latent: torch.Tensor, rope_key: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-head keys ``[B,H,L,d_n+d_r]`` (``W_UK,h c`` then the shared RoPE key) and values ``[B,H,L,d_v]``
    of ``latent [B,1,L,d_c]`` and ``rope_key [B,1,L,d_r]`` (``w_uk [H,d_n,d_c]``, ``w_uv [H,d_v,d_c]``)."""
    dt = latent.dtype
    k_nope = torch.einsum("bxlc,hdc->bhld", latent, w_uk.to(dt))
    k = torch.cat([k_nope, rope_key.to(dt).expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return k, torch.einsum("bxlc,hvc->bhlv", latent, w_uv.to(dt))


def padded_sdpa(q, k, v, scale: float, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """``scaled_dot_product_attention`` ``[B,H,S,d_v]`` with a boolean (True = attend) or additive ``mask``
    (``[B or 1, 1, S, L]`` or ``[S, L]``), and with ``causal`` also the causal limit aligned to the end. The
    head dims are zero-padded to one width (the fused kernels need equal widths; zeros change no score and no
    output), and a boolean mask that is only the causal one is passed as ``is_causal``."""
    s, l_kv = q.shape[-2], k.shape[-2]
    if causal:
        tri = torch.ones(s, l_kv, dtype=torch.bool, device=q.device).tril(l_kv - s)
        if mask is None and s != l_kv:
            mask = tri
        elif mask is not None and mask.dtype == torch.bool:
            mask = None if s == l_kv and torch.equal(mask, tri.expand_as(mask)) else mask & tri
        elif mask is not None:
            mask = torch.where(tri, mask.to(q.dtype), torch.finfo(q.dtype).min)
        causal = mask is None
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    d_v = v.shape[-1]
    q, k, v = pad_heads(max(q.shape[-1], d_v), q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out[..., :d_v]


def pad_heads(width: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor's last (head) dim zero-padded to ``width`` (unchanged where it is that wide already)."""
    return tuple(x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1])) for x in tensors)


def expanded_latent_attention(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale: float,
                              mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The attention of :func:`~quantmla.models.latent.absorbed_attention` (same shapes, same ``mask``
    convention: None is causal aligned to the end), computed in the expanded form. Returns ``[B,S,H,d_v]``."""
    k, v = expand_latent(latent, rope_key, w_uk, w_uv)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
    return padded_sdpa(q, k, v, scale, mask, causal=True).transpose(1, 2).contiguous()


def expanded_is_cheaper(queries: int, keys: int, d_c: int, d_n: int, d_r: int, d_v: int) -> bool:
    """Whether the expanded form does fewer multiply-adds than the absorbed one for ``queries`` over ``keys``
    (per head: expanding ``keys * (d_n + d_v) * d_c``, then ``d_n + d_r + d_v`` a pair, against
    ``2 d_c + d_r`` a pair absorbed; the queries' ``W_UK`` product, ``d_n * d_c`` each, and the output's
    ``W_UV`` product, ``d_v * d_c`` each, are saved too)."""
    absorbed = queries * keys * (2 * d_c + d_r) + queries * (d_n + d_v) * d_c
    expanded = keys * (d_n + d_v) * d_c + queries * keys * (d_n + d_r + d_v)
    return expanded < absorbed
