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
        if self.scheme.rope.page == self.scheme.content.page:  # one mask for both paths
            s_hp = (q_lat @ latent.transpose(-1, -2) + q_pe @ rope_key.transpose(-1, -2)).to(acc)
            s_q = (q_lat @ c_q.transpose(-1, -2) + q_pe @ k_q.transpose(-1, -2)).to(acc)
            scores = torch.where(hp, s_hp, s_q) * scale
        else:  # a paged path: each path read unquantised where its own mask says
            hp_r = self.full_precision_mask(s, q_nope.device, self.scheme.rope.page)
            s_c = torch.where(hp, (q_lat @ latent.transpose(-1, -2)).to(acc), (q_lat @ c_q.transpose(-1, -2)).to(acc))
            s_r = torch.where(hp_r, (q_pe @ rope_key.transpose(-1, -2)).to(acc), (q_pe @ k_q.transpose(-1, -2)).to(acc))
            scores = (s_c + s_r) * scale
        if mask is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).tril()
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(acc).min)
        else:
            scores = scores + mask.to(acc)
        probs = torch.softmax(scores, dim=-1)
        p_hp = torch.where(hp, probs, 0.0).to(latent.dtype)
        p_q = torch.where(hp, 0.0, probs).to(latent.dtype)
        o_lat = p_hp @ latent + p_q @ c_q
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
