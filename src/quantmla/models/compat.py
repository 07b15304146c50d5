"""Differences between the transformers versions we support (>= 5.15)."""

from __future__ import annotations

import inspect

from transformers import DeepseekV3ForCausalLM

#: name of the cache keyword of ``forward``/``generate``: 5.24 renamed ``past_key_values`` to ``cache``
CACHE_KWARG = "cache" if "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{CACHE_KWARG: cache}``, to pass a cache to ``model(...)`` or ``model.generate(...)``."""
    return {CACHE_KWARG: cache}


def output_cache(outputs):
    """The cache a forward returned, under either name."""
    return getattr(outputs, "cache", None) if CACHE_KWARG == "cache" else outputs.past_key_values
