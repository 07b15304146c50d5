"""The quantised decode cache as every query sees it, for a whole sequence in one forward.

During decode, the query at position t sees the first ``sink`` tokens and its last ``recent``
tokens (t itself included) unquantised and every other earlier token as stored (quantised once,
per token, so its stored value does not depend on when it was quantised). ``SimulatedDecodeCache``
reproduces exactly that for all queries of a sequence at once: it scores each key in both forms
and picks, per (query, key) pair, the one decode would see. It costs two attention passes instead
of one and equals token-by-token decoding through :class:`QuantizedLatentCache`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from quantmla.models.latent import module_states
from quantmla.quant.scheme import CacheScheme, parse_scheme

#: elements of one query chunk's score matrix ``[B, H, chunk, L]`` (bounds the memory of ``attend``; a module constant)
SCORE_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SimulatedDecodeCache:
    scheme: CacheScheme
    group_size: int = 64
    sink: int = 4
    recent: int = 128

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be >= 0")

    def full_precision_mask(self, s: int, device, page: int | None = None) -> torch.Tensor:
        """``[S, S]`` True where query t sees key j unquantised: the sinks and its last ``recent`` tokens, and
        for a per-channel-in-page path (``page``) also the tokens past the window whose page is not full yet
        (pages of the cache's middle: from position ``sink`` on, filled as tokens leave the window)."""
        t = torch.arange(s, device=device).unsqueeze(1)
        j = torch.arange(s, device=device).unsqueeze(0)
        if not self.scheme.quantized:
            return torch.ones(s, s, dtype=torch.bool, device=device)
        hp = (j < self.sink) | (j > t - self.recent)
        if page is None:
            return hp
        done = (t - self.recent - self.sink + 1).clamp_min(0) // page * page  # tokens in full pages of the middle
        return hp | (j >= self.sink + done)

    def quantize(self, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent and RoPE key as the cache stores them (dequantised; a paged path in pages from ``sink``)."""

        def stored(fmt, x):
            if fmt.page is None or not self.sink:
                return fmt.fake_quantize(x, self.group_size)
            return torch.cat([x[..., : self.sink, :], fmt.fake_quantize(x[..., self.sink :, :], self.group_size)], -2)

        return stored(self.scheme.content, latent), stored(self.scheme.rope, rope_key)

    def _unquantised_spans(self, i: int, e: int) -> list[tuple[int, int]]:
        """Key ranges that queries ``i..e-1`` may read unquantised (no paged path): the sinks, and the keys from
        ``i - recent + 1`` on (query t reads keys above ``t - recent`` as computed)."""
        n_sink = min(self.sink, e)
        start = max(n_sink, i - self.recent + 1)
        return [span for span in ((0, n_sink), (start, e)) if span[0] < span[1]]

    def attend(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask) -> torch.Tensor:
        s, l_kv = q_nope.shape[-2], latent.shape[-2]
        if s != l_kv:
            raise ValueError(
                f"the decode-cache simulation scores a whole sequence in one forward (no cache); got {s} queries "
                f"over {l_kv} keys. Call the model with use_cache=False."
            )
        c_q, k_q = self.quantize(latent, rope_key)
        q_lat = torch.einsum("bhsd,hdc->bhsc", q_nope, w_uk.to(q_nope.dtype))
        acc = torch.promote_types(q_lat.dtype, torch.float32)
        hp = self.full_precision_mask(s, q_nope.device, self.scheme.content.page)
        same = self.scheme.rope.page == self.scheme.content.page  # one mask for both paths
        hp_r = hp if same else self.full_precision_mask(s, q_nope.device, self.scheme.rope.page)
        if mask is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=q_nope.device).tril()
        # queries in chunks: the score matrices of one chunk are [B, H, chunk, <= L] (about 64M elements at most),
        # so 4K-token windows fit in memory; each query's softmax is over all the keys it can see, as in one pass
        b, h = q_lat.shape[0], q_lat.shape[1]
        chunk = max(16, SCORE_CHUNK_ELEMENTS // max(1, b * h * l_kv))
        # no paged path: the unquantised keys are the sinks and a band of recent keys, scored in a second pass
        # over those keys only (a paged path reads a filling page unquantised too: both passes over every key)
        band = same and self.scheme.content.page is None
        outs = []
        for i in range(0, s, chunk):
            e = min(s, i + chunk)  # queries i..e-1 see keys 0..e-1 at most (decode is causal): the rest is skipped
            rows = slice(i, e)
            ql, qp, m = q_lat[..., rows, :], q_pe[..., rows, :], mask[..., rows, :e]
            lat, rk, cq, kq = latent[..., :e, :], rope_key[..., :e, :], c_q[..., :e, :], k_q[..., :e, :]
            hp_c, hp_rc = hp[rows, :e], hp_r[rows, :e]
            if not self.scheme.quantized:  # every key as computed: one pass
                scores = (ql @ lat.transpose(-1, -2) + qp @ rk.transpose(-1, -2)).to(acc) * scale
                spans = None
            elif band:  # quantised keys everywhere, then the sinks and the recent band as computed
                scores = (ql @ cq.transpose(-1, -2) + qp @ kq.transpose(-1, -2)).to(acc)
                spans = self._unquantised_spans(i, e)
                segs, prev = [], 0
                for k0, k1 in spans:
                    exact = ql @ lat[..., k0:k1, :].transpose(-1, -2) + qp @ rk[..., k0:k1, :].transpose(-1, -2)
                    segs += [scores[..., prev:k0], torch.where(hp_c[:, k0:k1], exact.to(acc), scores[..., k0:k1])]
                    prev = k1
                scores = torch.cat([*segs, scores[..., prev:]], dim=-1) * scale
            elif same:
                s_hp = (ql @ lat.transpose(-1, -2) + qp @ rk.transpose(-1, -2)).to(acc)
                s_q = (ql @ cq.transpose(-1, -2) + qp @ kq.transpose(-1, -2)).to(acc)
                scores = torch.where(hp_c, s_hp, s_q) * scale
                spans = ((0, e),)
                del s_hp, s_q
            else:  # a paged path: each path read unquantised where its own mask says
                s_c = torch.where(hp_c, (ql @ lat.transpose(-1, -2)).to(acc), (ql @ cq.transpose(-1, -2)).to(acc))
                s_r = torch.where(hp_rc, (qp @ rk.transpose(-1, -2)).to(acc), (qp @ kq.transpose(-1, -2)).to(acc))
                scores = (s_c + s_r) * scale
                spans = ((0, e),)
                del s_c, s_r
            if m.dtype == torch.bool:
                scores = scores.masked_fill(~m, torch.finfo(acc).min)
            else:
                scores = scores + m.to(acc)
            probs = torch.softmax(scores, dim=-1)
            del scores
            if spans is None:
                outs.append(probs.to(latent.dtype) @ lat)
                continue
            # sum_j p_j v_j with v_j the stored value, plus, where read unquantised, p_j (c_j - stored c_j)
            o = probs.to(latent.dtype) @ cq
            for k0, k1 in spans:
                p_hp = torch.where(hp_c[:, k0:k1], probs[..., k0:k1], 0.0).to(latent.dtype)
                o = o + p_hp @ (lat[..., k0:k1, :] - cq[..., k0:k1, :])
            outs.append(o)
        o_lat = torch.cat(outs, dim=-2)
        out = torch.einsum("bhsc,hvc->bhsv", o_lat, w_uv.to(o_lat.dtype))
        return out.transpose(1, 2).contiguous()


@contextmanager
def installed(states: list, sims: list) -> Iterator[None]:
    """Within the block, each latent-attention module state attends through its simulation."""
    for st, sim in zip(states, sims, strict=True):
        st.simulation = sim
    try:
        yield
    finally:
        for st in states:
            st.simulation = None


@contextmanager
def simulated_decode(
    model: nn.Module, scheme: str | CacheScheme, group_size: int = 64, sink: int = 4, recent: int = 128
) -> Iterator[SimulatedDecodeCache]:
    """Within the block, forwards of ``model`` (latent attention enabled) see the cache as decode does."""
    sim = SimulatedDecodeCache(parse_scheme(scheme), group_size, sink, recent)
    states = module_states(model)
    with installed(states, [sim] * len(states)):
        yield sim
