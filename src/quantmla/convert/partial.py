"""The converted layers run inside the source model (MHA2MLA's form: per-KV-head RoPE pairs at their source
frequencies, one latent for the NoPE keys and the values): the reference the export is measured against, and
the form in which the choices DeepSeek's format cannot express (per-head pairs) are measured. Full-sequence
forwards only (no generation cache)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.convert.source import SourceShape, decoder_layers
from quantmla.convert.surgery import LatentLayer, rope_dims


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE within ``x``'s last dim (``2r``: first halves of ``r`` pairs, then second halves)."""
    r = x.shape[-1] // 2
    x1, x2 = x[..., :r], x[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class LatentAttention(nn.Module):
    """A :class:`LatentLayer` in place of a source ``self_attn`` (its ``o_proj`` kept)."""

    def __init__(self, layer: LatentLayer, shape: SourceShape, o_proj: nn.Module, latent_gain: float | None = None,
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        super().__init__()
        self.shape, self.o_proj, self.eps, self.biased = shape, o_proj, layer.eps, layer.biased
        self.latent_gain = latent_gain
        d, kv, g = shape.head_dim, shape.num_kv_heads, shape.group
        dims = [rope_dims(layer.pairs[i], d) for i in range(kv)]
        rope_idx = torch.stack([dims[i][0] for i in range(kv)]).repeat_interleave(g, 0)  # (heads, 2r)
        nope_idx = torch.stack([dims[i][1] for i in range(kv)]).repeat_interleave(g, 0)
        self.register_buffer("q_rope_idx", rope_idx, persistent=False)
        self.register_buffer("q_nope_idx", nope_idx, persistent=False)
        self.register_buffer("pairs", layer.pairs.clone(), persistent=False)
        buf = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        self.register_buffer("wq", buf(layer.wq), persistent=False)
        self.register_buffer("bq", buf(layer.bq), persistent=False)
        self.register_buffer("q_gain", buf(layer.q_gain), persistent=False)
        self.register_buffer("wkr", buf(layer.wkr), persistent=False)
        self.register_buffer("down", buf(layer.down), persistent=False)
        self.register_buffer("up_k", buf(layer.up_k), persistent=False)
        self.register_buffer("up_v", buf(layer.up_v), persistent=False)

    def augmented(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the constant 1 appended where the keys or values have biases (the rows' last column)."""
        return torch.cat([x, torch.ones_like(x[..., :1])], -1) if self.biased else x

    def latent(self, xa: torch.Tensor) -> torch.Tensor:
        """The cached latent of the augmented input ``xa`` (``(..., latent)``), after the latent norm where one is
        set."""
        c = xa @ self.down.T
        return c if self.latent_gain is None else self.latent_gain * rms_norm(c, self.eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        if past_key_values is not None and kwargs.get("use_cache", True):
            raise ValueError("the converted layers in the source model run full sequences only (use_cache=False)")
        sh = self.shape
        b, t, _ = hidden_states.shape
        d, g = sh.head_dim, sh.group
        x = hidden_states
        q = F.linear(x, self.wq, self.bq).view(b, t, sh.num_heads, d)
        if self.q_gain is not None:
            q = self.q_gain * rms_norm(q, self.eps)
        cos, sin = position_embeddings  # (b, t, d): rotate-half layout, pair k at columns k and k + d/2
        cos_k = cos[..., self.pairs].to(x.dtype)  # (b, t, kv, r)
        sin_k = sin[..., self.pairs].to(x.dtype)
        cos_q, sin_q = cos_k.repeat_interleave(g, 2), sin_k.repeat_interleave(g, 2)
        q_rope = rotate(torch.gather(q, 3, self.q_rope_idx.expand(b, t, -1, -1)), cos_q, sin_q)
        q_nope = torch.gather(q, 3, self.q_nope_idx.expand(b, t, -1, -1))
        xa = self.augmented(x)
        k_rope = rotate(torch.einsum("btn,grn->btgr", xa, self.wkr), cos_k, sin_k)
        c = self.latent(xa)
        k_nope = torch.einsum("btc,grc->btgr", c, self.up_k)
        v = torch.einsum("btc,grc->btgr", c, self.up_v)
        qh = torch.cat([q_rope, q_nope], -1).transpose(1, 2)
        kh = torch.cat([k_rope, k_nope], -1).repeat_interleave(g, 2).transpose(1, 2)
        vh = v.repeat_interleave(g, 2).transpose(1, 2)
        mask, causal = None, attention_mask is None
        if attention_mask is not None:
            mask = attention_mask[..., :t, :t]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=1 / math.sqrt(d))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), None


def install_latent(model: nn.Module, shape: SourceShape, layers: list[LatentLayer],
                   latent_gains: list[float] | None = None) -> None:  # fmt: skip
    """Replace every ``self_attn`` of the source ``model`` by its converted layer (in place)."""
    dtype = next(model.parameters()).dtype
    for i, (dec, layer) in enumerate(zip(decoder_layers(model), layers, strict=True)):
        gain = None if latent_gains is None else latent_gains[i]
        dec.self_attn = LatentAttention(layer, shape, dec.self_attn.o_proj, gain, dtype).to(
            dec.self_attn.o_proj.weight.device
        )
