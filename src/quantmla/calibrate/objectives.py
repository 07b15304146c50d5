"""Function-aligned calibration objectives with the quantiser in the loop (METHOD.md section 4).

* content: attention-output reconstruction ``||Attn(q, Q(c'), k^R) - Attn(q, c, k^R)||^2`` (causal,
  through the module's own forward), with ``c' = c diag(g)^-1 R S`` quantised and mapped back;
* RoPE: positional score reconstruction ``sum_{t >= j} (q_t . k_j - q'_t . Q(k'_j))^2`` with
  ``k' = k B``, ``q' = q B^-T``.

The quantiser uses a straight-through estimator: the forward value is quantised, the gradient is
the identity.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from quantmla.formats.scheme import PathFormat
from quantmla.measure.attention import run_attention
from quantmla.measure.capture import AttentionCall
from quantmla.measure.layer_inputs import LayerInputs, ModelInputs
from quantmla.models.adapter import MLAAdapter
from quantmla.models.latent import absorbed_attention, module_state


def ste_quantize(x: torch.Tensor, fmt: PathFormat, group_size: int) -> torch.Tensor:
    """``fmt``'s fake quantisation of ``x`` (the forward value exactly), with the identity as gradient."""
    return fmt.fake_quantize(x.detach(), group_size) + (x - x.detach())


class _QueryRecorder:
    """Latent-attention hook that records the RoPE'd queries and attends normally."""

    def __init__(self) -> None:
        self.q_pe = None

    def attend(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask):
        self.q_pe = q_pe.detach()
        return absorbed_attention(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask)


@dataclass
class LayerBatch:
    call: AttentionCall
    out: torch.Tensor  # clean attention-module output
    c: torch.Tensor  # clean cached latent [B, 1, T, d_c]
    r: torch.Tensor  # clean cached RoPE key [B, 1, T, d_r]
    q_pe: torch.Tensor  # RoPE'd queries [B, H, T, d_r]


@torch.no_grad()
def collect(source: nn.Module | LayerInputs, index: int, windows: torch.Tensor, batch_size: int) -> list[LayerBatch]:
    """Capture attention module ``index``'s inputs and clean tensors for ``windows [N, T]``: from a model in memory,
    or from a :class:`~quantmla.measure.layer_inputs.StreamedInputs` at that layer."""
    inputs = ModelInputs(source) if isinstance(source, nn.Module) else source
    out = []
    for call in inputs.attention_calls(index, windows, batch_size):
        state = module_state(call.module)
        if state is None:
            raise ValueError(f"attention module {index} has no latent attention; call enable_latent_attention first")
        rec = _QueryRecorder()
        with attending_through(call.module, rec):
            o, c, r = run_attention(call)
        out.append(LayerBatch(call, o.detach(), c.detach(), r.detach(), rec.q_pe))
    return out


@contextmanager
def attending_through(module: nn.Module, attention) -> Iterator[None]:
    """Within the block, latent-attention module ``module`` attends through ``attention`` (an object with the
    ``attend`` of :func:`~quantmla.models.latent.absorbed_attention`'s arguments)."""
    state = module_state(module)
    if state is None:
        raise ValueError("latent attention is not enabled on this module; call enable_latent_attention first")
    prev, state.simulation = state.simulation, attention
    try:
        yield
    finally:
        state.simulation = prev


class _ProbabilityRecorder:
    """Attends as the absorbed reference and keeps the attention probabilities ``[B, H, S, L]``."""

    probs: torch.Tensor | None = None

    def attend(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask):
        out, self.probs = absorbed_attention(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask,
                                             return_probs=True)  # fmt: skip
        return out


def attention_probs(batch: LayerBatch, delta_c: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module output, attention probabilities)`` of ``batch``'s call with ``delta_c`` added to the latent."""
    rec = _ProbabilityRecorder()
    with attending_through(batch.call.module, rec):
        out = run_attention(batch.call, delta_c=delta_c)[0]
    return out, rec.probs


def content_maps(g, rotation, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, M^-1)`` with ``M = diag(g)^-1 R S``: the fused model caches ``c M``.

    Written entry-wise (``R_ij s_j / g_i`` and ``R_ji g_j / s_i``) so that the original-basis identity
    (``R = diag(sign g)``, ``s = |g|``) gives exactly the identity matrix in any dtype.
    """
    m = rotation * scales[None, :] / g[:, None]
    m_inv = rotation.T * g[None, :] / scales[:, None]
    return m, m_inv


def quantize_content(c, g, rotation, scales, fmt: PathFormat, group_size: int) -> torch.Tensor:
    """``c`` quantised (STE) in the basis ``c diag(g)^-1 R S`` the fused model caches, mapped back."""
    dt, dev = c.dtype, c.device
    m, m_inv = content_maps(g.to(dev, dt), rotation.to(dev, dt), scales.to(dev, dt))
    return ste_quantize(c @ m, fmt, group_size) @ m_inv


def quantize_rope(k, b, b_inv, fmt: PathFormat, group_size: int) -> torch.Tensor:
    """The RoPE key quantised (STE) in the basis ``k B`` the fused model caches, mapped back with ``B^-1``."""
    dt, dev = k.dtype, k.device
    return ste_quantize(k @ b.to(dev, dt), fmt, group_size) @ b_inv.to(dev, dt)


def latent_gain(adapter: MLAAdapter, attn: nn.Module) -> torch.Tensor:
    """``g``, the ``kv_a_layernorm`` weight: the cache of the fused model is ``c diag(g)^-1 R S``.

    LongCat's latent scale multiplies after the norm and stays in the fused model, so it stays in
    ``c diag(g)^-1`` too: the quantiser sees exactly the tensor the fused model caches (its scale
    and minimum are stored in fp16, so a constant factor is not exactly neutral).
    """
    return adapter.kv_norm(attn).weight.detach().double()


def content_loss(
    batch: LayerBatch, g: torch.Tensor, rotation: torch.Tensor, scales: torch.Tensor, fmt: PathFormat, group_size: int
) -> torch.Tensor:
    """Normalised attention-output error with the content path quantised in the transformed basis."""
    c_hat = quantize_content(batch.c, g, rotation, scales, fmt, group_size)
    out = run_attention(batch.call, delta_c=c_hat - batch.c)[0]
    return (out - batch.out).pow(2).sum() / batch.out.pow(2).sum()


def rope_loss(
    batch: LayerBatch, b: torch.Tensor, b_inv: torch.Tensor, fmt: PathFormat, group_size: int
) -> torch.Tensor:
    """Normalised causal q.k error with the RoPE key quantised in the transformed basis."""
    k = batch.r[:, 0]  # [B, T, d_r]
    k_hat = quantize_rope(k, b, b_inv, fmt, group_size)
    q = batch.q_pe  # [B, H, T, d_r]
    t = k.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=k.device).tril()
    ref = q @ k.unsqueeze(1).transpose(-1, -2)
    err = q @ (k_hat - k).unsqueeze(1).transpose(-1, -2)
    return err.masked_fill(~causal, 0).pow(2).sum() / ref.masked_fill(~causal, 0).pow(2).sum()
