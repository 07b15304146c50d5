"""One captured attention call run again, with its cache paths perturbed: the functional error of a change
to the content latent or the RoPE key, as analysis and calibration measure it."""

from __future__ import annotations

import torch

from quantmla.measure.capture import AttentionCall
from quantmla.models.compat import CACHE_KWARG


class PerturbingCache:
    """Stands in for the cache during one attention call: records the clean latent and RoPE key
    the module computed and hands them back with the given perturbations added."""

    def __init__(self, delta_c: torch.Tensor | None, delta_r: torch.Tensor | None) -> None:
        self.delta_c, self.delta_r = delta_c, delta_r
        self.c = self.r = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.c, self.r = key_states, value_states
        c = key_states if self.delta_c is None else key_states + self.delta_c
        r = value_states if self.delta_r is None else value_states + self.delta_r
        return c, r


def run_attention(call: AttentionCall, delta_c=None, delta_r=None):
    """``(output, clean latent, clean RoPE key)`` of the captured call with perturbed cache paths."""
    cache = PerturbingCache(delta_c, delta_r)
    kwargs = {k: v for k, v in call.kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
    kwargs[CACHE_KWARG] = cache
    out = call.module(*call.args, **kwargs)[0]
    return out, cache.c, cache.r
