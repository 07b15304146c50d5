"""Calibration statistics of each attention layer, gathered in one pass of the source model over the calibration
tokens (float64 sums; nothing per token is kept):

- the second moment of the attention's input (with a constant 1 appended where the keys or values have biases),
  which weights the latent factorisation and gives every linear function of the input's second moment;
- E||q_pair|| per query head and E||k_pair|| per KV head, after q_norm/k_norm (the contribution score), and
  E||q_pair||^2 (how much each query head reads a pair);
- the sums that fit Qwen3's k_norm by one constant per KV head, and q_norm's per-head RMS by the RMS over all
  heads times a constant per head (the one norm DeepSeek's query path has).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from quantmla.convert.source import SourceAttention, SourceShape, decoder_layers, read_attention


@dataclass
class LayerStats:
    xx: torch.Tensor  # (n, n): sum of x x^T (n = hidden, + 1 with biases)
    tokens: int
    q_pair_norm: torch.Tensor  # (heads, pairs): sum of ||q_pair||
    q_pair_sq: torch.Tensor  # (heads, pairs): sum of ||q_pair||^2
    k_pair_norm: torch.Tensor  # (kv, pairs): sum of ||k_pair||
    knorm_num: torch.Tensor  # (kv,): sum of ||g k||^2 / rms(k)
    knorm_den: torch.Tensor  # (kv,): sum of ||g k||^2
    qnorm_num: torch.Tensor  # (heads,): sum of w / (rms_h rms_all), w = ||g q_h||^2
    qnorm_den: torch.Tensor  # (heads,): sum of w / rms_all^2
    q_rms: torch.Tensor  # (): sum of rms_all(q) over all heads (before q_norm)
    q_moment: torch.Tensor  # (heads, d, d): sum of q q^T per head (after q_norm)

    @property
    def second_moment(self) -> torch.Tensor:
        return self.xx / max(self.tokens, 1)

    def knorm_scale(self) -> torch.Tensor:
        """The constant per KV head that replaces k_norm's 1/rms(k) (least squares on the normed key)."""
        return self.knorm_num / self.knorm_den

    def qnorm_scale(self) -> torch.Tensor:
        """The constant per query head c_h with 1/rms_h(q_h) ~ c_h / rms_all(q) (least squares)."""
        return self.qnorm_num / self.qnorm_den

    def mean_q_rms(self) -> torch.Tensor:
        return self.q_rms / max(self.tokens, 1)

    def query_moment(self) -> torch.Tensor:
        """``(heads, d, d)``: E[q q^T] per query head, after q_norm."""
        return self.q_moment / max(self.tokens, 1)

    def mean_q_pair(self) -> torch.Tensor:
        return self.q_pair_norm / max(self.tokens, 1)

    def mean_k_pair(self) -> torch.Tensor:
        return self.k_pair_norm / max(self.tokens, 1)

    def mean_q_pair_sq(self) -> torch.Tensor:
        return self.q_pair_sq / max(self.tokens, 1)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt(x.pow(2).mean(-1) + eps)


def _pair_norm(x: torch.Tensor) -> torch.Tensor:
    """``(..., d) -> (..., d/2)``: the norm of each rotate-half pair ``(k, k + d/2)``."""
    half = x.shape[-1] // 2
    return torch.sqrt(x[..., :half].pow(2) + x[..., half:].pow(2))


class LayerAccumulator:
    """One layer's :class:`LayerStats`, summed over the attention inputs given to :meth:`add`."""

    def __init__(self, src: SourceAttention, shape: SourceShape):
        self.src, self.shape = src, shape
        n = shape.hidden_size + int(src.has_kv_bias)
        pairs = shape.head_dim // 2
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.stats = LayerStats(
            xx=z(n, n), tokens=0,
            q_pair_norm=z(shape.num_heads, pairs), q_pair_sq=z(shape.num_heads, pairs),
            k_pair_norm=z(shape.num_kv_heads, pairs),
            knorm_num=z(shape.num_kv_heads), knorm_den=z(shape.num_kv_heads),
            qnorm_num=z(shape.num_heads), qnorm_den=z(shape.num_heads), q_rms=z(()),
            q_moment=z(shape.num_heads, shape.head_dim, shape.head_dim),
        )  # fmt: skip

    def add(self, x: torch.Tensor) -> None:
        s, src, sh = self.stats, self.src, self.shape
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64).cpu()
        xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1) if src.has_kv_bias else x
        s.xx += xa.T @ xa
        s.tokens += len(x)
        d = sh.head_dim
        q = (x @ src.wq.T + (src.bq if src.bq is not None else 0)).view(len(x), sh.num_heads, d)
        k = (x @ src.wk.T + (src.bk if src.bk is not None else 0)).view(len(x), sh.num_kv_heads, d)
        eps = src.eps
        s.q_rms += _rms(q.reshape(len(x), -1), eps).sum()
        if src.q_gain is not None:
            rms_h, rms_all = _rms(q, eps), _rms(q.reshape(len(x), -1), eps)[:, None]
            w = (q * src.q_gain).pow(2).sum(-1)
            s.qnorm_num += (w / (rms_h * rms_all)).sum(0)
            s.qnorm_den += (w / rms_all**2).sum(0)
            q = src.q_gain * q / rms_h[..., None]
        if src.k_gain is not None:
            rms = _rms(k, eps)
            w = (k * src.k_gain).pow(2).sum(-1)
            s.knorm_num += (w / rms).sum(0)
            s.knorm_den += w.sum(0)
            k = src.k_gain * k / rms[..., None]
        s.q_moment += torch.einsum("thd,the->hde", q, q)
        qp = _pair_norm(q)
        s.q_pair_norm += qp.sum(0)
        s.q_pair_sq += qp.pow(2).sum(0)
        s.k_pair_norm += _pair_norm(k).sum(0)


@torch.no_grad()
def gather_stats(
    model: nn.Module, shape: SourceShape, batches: list[torch.Tensor], progress: bool = True
) -> list[LayerStats]:
    """Every layer's :class:`LayerStats` over ``batches`` of token ids (each ``(B, T)``), one forward a batch."""
    layers = decoder_layers(model)
    accs = [LayerAccumulator(read_attention(layer.self_attn, shape), shape) for layer in layers]
    handles = []
    for layer, acc in zip(layers, accs, strict=True):

        def hook(module, args, kwargs, acc=acc):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            acc.add(hidden)

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    device = next(model.parameters()).device
    try:
        for ids in tqdm(batches, desc="calibration statistics", unit="batch", disable=not progress):
            model(ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [a.stats for a in accs]
