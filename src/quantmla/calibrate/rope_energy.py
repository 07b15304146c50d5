"""Block-GTQ's label-free score of each RoPE frequency block, measured per layer on calibration tokens.

For block ``i`` (one 2-D pair of the RoPE key) the score is ``s_i = (E||q_i||^2 + E||k_i||^2) / 2``, the mean
energy of the block in the queries (every head a sample) and in the keys (Block-GTQ's
``compute_freq_importance_energy``). A block's norm does not change under RoPE, so the rotated vectors the
attention sees give the same score as the pre-RoPE ones. The queries and keys are read where latent attention
receives them, in the cache's channel layout, during ordinary forwards of the full-precision model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantmla.formats.scheme import PathFormat
from quantmla.measure.attention import run_attention
from quantmla.measure.simulate import installed
from quantmla.models.adapter import get_adapter
from quantmla.models.expanded import expanded_latent_attention
from quantmla.models.latent import (
    enable_latent_attention,
    is_latent_attention_enabled,
    module_state,
    module_states,
)
from quantmla.quant.allocate import greedy_allocation
from quantmla.quant.mixed import pair_channel_bits


@dataclass(eq=False)
class _EnergyProbe:
    """Stands in for a module's attention: accumulates per-block energies, then attends unchanged."""

    pairs: torch.Tensor  # [P, 2] channels of each block, cache layout
    q_sum: torch.Tensor | None = None
    k_sum: torch.Tensor | None = None
    q_count: int = 0
    k_count: int = 0

    def attend(self, q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask):
        p = self.pairs.to(q_pe.device)
        q = q_pe.double().reshape(-1, q_pe.shape[-1])[:, p].pow(2).sum(-1)  # [B*H*S, P]
        k = rope_key.double().reshape(-1, rope_key.shape[-1])[:, p].pow(2).sum(-1)
        self.q_sum = q.sum(0) if self.q_sum is None else self.q_sum + q.sum(0)
        self.k_sum = k.sum(0) if self.k_sum is None else self.k_sum + k.sum(0)
        self.q_count += q.shape[0]
        self.k_count += k.shape[0]
        return expanded_latent_attention(q_nope, q_pe, latent, rope_key, w_uk, w_uv, scale, mask)

    def scores(self, keys_only: bool = False) -> torch.Tensor:
        k = self.k_sum / self.k_count
        return (k if keys_only else (self.q_sum / self.q_count + k) / 2).cpu()


@torch.no_grad()
def rope_block_scores(model: nn.Module, windows: torch.Tensor, batch_size: int = 4, keys_only: bool = False
                      ) -> dict[int, torch.Tensor]:  # fmt: skip
    """``{cache index: [P] float64}``: Block-GTQ's score of each RoPE block, per layer, over ``windows [N, T]``
    of token ids (the full-precision model, no cache); ``keys_only``: ``E||k_i||^2`` alone."""
    if windows.dim() != 2 or windows.shape[0] == 0:
        raise ValueError(f"windows must be [N >= 1, T] token ids, got {tuple(windows.shape)}")
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    d_r = modules[0][1].qk_rope_head_dim
    pairs = adapter.rope_layout(model.config).cache_pairs(d_r)
    probes = [_EnergyProbe(pairs) for _ in modules]
    device = next(model.parameters()).device
    with installed(module_states(model), probes):
        for start in range(0, windows.shape[0], batch_size):
            model(windows[start : start + batch_size].to(device), use_cache=False)
    return {idx: probe.scores(keys_only) for (idx, _), probe in zip(modules, probes, strict=True)}


@torch.no_grad()
def layer_block_scores(inputs, index: int, windows: torch.Tensor, batch_size: int, pairs: torch.Tensor,
                       keys_only: bool = False) -> torch.Tensor:  # fmt: skip
    """Layer ``index``'s scores of :func:`rope_block_scores`, its attention calls taken from ``inputs`` (a
    :class:`~quantmla.measure.layer_inputs.StreamedInputs` at that layer): the same calls, so the same scores."""
    probe = _EnergyProbe(pairs)
    for call in inputs.attention_calls(index, windows, batch_size):
        with installed([module_state(call.module)], [probe]):
            run_attention(call)
    return probe.scores(keys_only)


def allocated_formats(scores: dict[int, torch.Tensor], pairs: torch.Tensor, mean_bits: int, min_bits: int = 1,
                      max_bits: int = 6) -> dict[int, PathFormat]:  # fmt: skip
    """Block-GTQ's RoPE format per layer: widths per block by greedy marginal gain under ``mean_bits`` a block on
    average (:func:`~quantmla.quant.allocate.greedy_allocation`), stored in TQ-MSE per group of equal width."""
    out = {}
    for idx, s in scores.items():
        widths = greedy_allocation(s, mean_bits * pairs.shape[0], min_bits, max_bits)
        out[idx] = PathFormat("int", channel_bits=pair_channel_bits(widths, pairs.tolist()), turbo=True)
    return out
