"""The quantised decode cache as every query sees it, for a whole sequence in one forward.

During decode, the query at position t sees the first ``sink`` tokens and its last ``recent``
tokens (t itself included) unquantised (the window policy, :class:`~quantmla.formats.windows.WindowPolicy`)
and every other earlier token as stored (quantised once,
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

from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec, model_codec
from quantmla.formats.scheme import CacheScheme
from quantmla.formats.windows import WindowPolicy
from quantmla.models.adapter import get_adapter
from quantmla.models.expanded import expand_latent, expanded_latent_attention, pad_heads, padded_sdpa
from quantmla.models.latent import module_state, module_states

#: elements of one query chunk's score matrix ``[B, H, chunk, L]`` (bounds the memory of ``attend``; a module
#: constant: 64 MB of float32 scores where they are formed)
SCORE_CHUNK_ELEMENTS = 1 << 24
#: queries per chunk of the token-granular (expanded) path, whose fused attention kernels form no score matrix:
#: each chunk copies the keys it sees once, so larger chunks copy less (a module constant)
QUERY_CHUNK = 512


@dataclass(frozen=True)
class SimulatedDecodeCache:
    scheme: CacheScheme
    group_size: int = 64
    sink: int = 4
    recent: int = 128
    #: what a calibration method fitted for this layer's cache (:mod:`~quantmla.formats.codec`; its scheme is
    #: ``scheme``): write-side transforms, attended with their read-side compensation, and learned ranges
    codec: LayerCodec | None = None

    def __post_init__(self) -> None:
        WindowPolicy(self.sink, self.recent)  # validates
        if self.codec is not None and self.codec.scheme.name != self.scheme.name:
            raise ValueError(f"codec of scheme {self.codec.scheme.name!r} in a simulation of {self.scheme.name!r}")

    @property
    def windows(self) -> WindowPolicy:
        return WindowPolicy(self.sink, self.recent)

    def _paths(self) -> tuple[PathCodec, PathCodec]:
        if self.codec is not None:
            return self.codec.content, self.codec.rope
        return PathCodec(self.scheme.content), PathCodec(self.scheme.rope)

    def full_precision_mask(self, s: int, device, page: int | None = None) -> torch.Tensor:
        """``[S, S]`` True where query t sees key j unquantised: the sinks and its last ``recent`` tokens, and
        for a per-channel-in-page path (``page``) also the tokens past the window whose page is not full yet
        (pages of the cache's middle: from position ``sink`` on, filled as tokens leave the window)."""
        if not self.scheme.quantized:
            return torch.ones(s, s, dtype=torch.bool, device=device)
        hp = self.windows.decode_mask(s, device)
        if page is None:
            return hp
        t = torch.arange(s, device=device).unsqueeze(1)
        j = torch.arange(s, device=device).unsqueeze(0)
        # tokens in full pages of the middle (filled from position ``sink`` on as tokens leave the window)
        done = (t - self.recent - self.sink + 1).clamp_min(0) // page * page
        return hp | (j >= self.sink + done)

    def quantize(self, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent and RoPE key as the cache stores them (dequantised; a paged path in pages from ``sink``)."""

        def stored(path: PathCodec, x):
            if path.fmt.page is None or not self.sink:
                return path.stored(x, self.group_size)
            return torch.cat([x[..., : self.sink, :], path.stored(x[..., self.sink :, :], self.group_size)], -2)

        content, rope = self._paths()
        return stored(content, latent), stored(rope, rope_key)

    def _unquantised_spans(self, i: int, e: int) -> list[tuple[int, int]]:
        """Key ranges that queries ``i..e-1`` may read unquantised (no paged path): the sinks, and the keys from
        the first query's recent window on (query ``t``, a request of ``t + 1`` tokens, reads ``[t + 1 - recent,
        t]`` as computed); the mask of :meth:`full_precision_mask` picks per pair."""
        n_sink = min(self.sink, e)
        start = max(n_sink, i + 1 - self.recent)
        return [span for span in ((0, n_sink), (start, e)) if span[0] < span[1]]

    def attend(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask) -> torch.Tensor:
        s, l_kv = q_nope.shape[-2], latent.shape[-2]
        if s != l_kv:
            raise ValueError(
                f"the decode-cache simulation scores a whole sequence in one forward (no cache); got {s} queries "
                f"over {l_kv} keys. Call the model with use_cache=False."
            )
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        if self.codec is not None:  # into the stored space; the read side compensates (exact at full precision)
            content, rope = self.codec.content, self.codec.rope
            latent, rope_key, q_pe = content.forward(latent), rope.forward(rope_key), rope.compensate(q_pe)
            w_uk, w_uv = content.compensate(w_uk), content.compensate(w_uv)
        if self.scheme.content.page is None and self.scheme.rope.page is None:
            return self._attend_expanded(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask)
        return self._attend_paged(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask)

    def _attend_expanded(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask) -> torch.Tensor:
        """Token-granular schemes: per-head keys and values expanded from the latent (``W_UK c``, ``W_UV c``:
        the same scores and outputs as the absorbed form, at ``d_nope + d_rope`` and ``d_v`` per pair instead of
        ``d_c + d_rope`` and ``d_c``), attended with ``scaled_dot_product_attention``. A query chunk attends over
        the stored (quantised) keys it can see, plus the sinks and its recent band as computed, with a mask that
        gives each (query, key) pair exactly one of the two forms."""
        s = q_nope.shape[-2]
        if not self.scheme.quantized:  # every key as computed: one causal pass
            return expanded_latent_attention(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask)
        k, v = expand_latent(latent, rope_key, w_uk, w_uv)
        k_q, v_q = expand_latent(*self.quantize(latent, rope_key), w_uk, w_uv)
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
        d_v = v.shape[-1]
        # one head width for the fused kernels, padded once here rather than per chunk (zeros change nothing)
        q, k, k_q, v, v_q = pad_heads(max(q.shape[-1], d_v), q, k, k_q, v, v_q)
        full = self.full_precision_mask(s, q.device)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        outs = []
        for i in range(0, s, QUERY_CHUNK):
            e = min(s, i + QUERY_CHUNK)  # queries i..e-1 see keys 0..e-1 at most (decode is causal)
            hp, seen = full[i:e, :e], causal[i:e, :e]
            spans = self._unquantised_spans(i, e)
            keys, values, allowed = [k_q[..., :e, :]], [v_q[..., :e, :]], [seen & ~hp]
            for k0, k1 in spans:  # the same keys as computed, where decode reads them so
                keys.append(k[..., k0:k1, :])
                values.append(v[..., k0:k1, :])
                allowed.append(hp[:, k0:k1] & seen[:, k0:k1])
            m = torch.cat(allowed, dim=-1)  # [chunk, keys]
            if mask is not None:
                given = mask[..., i:e, :e]
                given = torch.cat([given, *(given[..., k0:k1] for k0, k1 in spans)], dim=-1)
                low = torch.finfo(q.dtype).min
                m = m & given if given.dtype == torch.bool else torch.where(m, given.to(q.dtype), low)
            outs.append(padded_sdpa(q[..., i:e, :], torch.cat(keys, -2), torch.cat(values, -2), scale, m, False))
        return torch.cat(outs, dim=-2)[..., :d_v].transpose(1, 2).contiguous()

    def _attend_paged(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask) -> torch.Tensor:
        """A per-channel-in-page path: each path read unquantised where its own mask says (the filling page
        too), so scores are formed in the absorbed form, per query chunk, both paths over every key."""
        s, l_kv = q_nope.shape[-2], latent.shape[-2]
        c_q, k_q = self.quantize(latent, rope_key)
        q_lat = torch.einsum("bhsd,hdc->bhsc", q_nope, w_uk.to(q_nope.dtype))
        acc = torch.promote_types(q_lat.dtype, torch.float32)
        hp = self.full_precision_mask(s, q_nope.device, self.scheme.content.page)
        same = self.scheme.rope.page == self.scheme.content.page  # one mask for both paths
        hp_r = hp if same else self.full_precision_mask(s, q_nope.device, self.scheme.rope.page)
        if mask is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=q_nope.device).tril()
        b, h = q_lat.shape[0], q_lat.shape[1]
        chunk = max(16, SCORE_CHUNK_ELEMENTS // max(1, b * h * l_kv))
        outs = []
        for i in range(0, s, chunk):
            e = min(s, i + chunk)
            rows = slice(i, e)
            ql, qp, m = q_lat[..., rows, :], q_pe[..., rows, :], mask[..., rows, :e]
            lat, rk, cq, kq = latent[..., :e, :], rope_key[..., :e, :], c_q[..., :e, :], k_q[..., :e, :]
            hp_c, hp_rc = hp[rows, :e], hp_r[rows, :e]
            s_c = torch.where(hp_c, (ql @ lat.transpose(-1, -2)).to(acc), (ql @ cq.transpose(-1, -2)).to(acc))
            s_r = torch.where(hp_rc, (qp @ rk.transpose(-1, -2)).to(acc), (qp @ kq.transpose(-1, -2)).to(acc))
            scores = (s_c + s_r) * scale
            del s_c, s_r
            if m.dtype == torch.bool:
                scores = scores.masked_fill(~m, torch.finfo(acc).min)
            else:
                scores = scores + m.to(acc)
            probs = torch.softmax(scores, dim=-1)
            del scores
            # sum_j p_j v_j with v_j the stored value, plus, where read unquantised, p_j (c_j - stored c_j)
            p_hp = torch.where(hp_c, probs, 0.0).to(latent.dtype)
            outs.append(probs.to(latent.dtype) @ cq + p_hp @ (lat - cq))
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
    model: nn.Module, scheme: str | CacheScheme | ModelCodec, group_size: int = 64, sink: int = 4, recent: int = 128
) -> Iterator[list[SimulatedDecodeCache]]:
    """Within the block, forwards of ``model`` (latent attention enabled) see the cache as decode does: each
    layer its codec's format and fitted parameters (a scheme: the same on every layer)."""
    module_states(model)  # latent attention must be enabled
    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    codec = model_codec(scheme, adapter.num_cache_layers(model.config))
    states = [module_state(attn) for _, attn in modules]
    layers = [codec.layers[idx] for idx, _ in modules]
    sims = [SimulatedDecodeCache(lc.scheme, group_size, sink, recent, lc if lc.fitted else None) for lc in layers]
    with installed(states, sims):
        yield sims
