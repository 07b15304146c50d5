"""pytest plugin: transformers' own DeepSeek-V2/V3 model tests with quantmla's latent attention and quantised cache.

Loaded by ``scripts/transformers_model_tests.sh`` (``-p quantmla_hf_suite`` with ``scripts/`` on ``PYTHONPATH``).
For the whole session it

* (a) applies :func:`quantmla.enable_latent_attention` to every DeepSeek-V2/V3 model the tests build whose
  attention implementation was not asked for explicitly (the default, ``sdpa``): a test that asks for ``eager``
  (or another implementation) by name gets it, with latent attention installed but inactive, so switching the
  implementation back and forth goes through quantmla's pass-through ``expand_kv``;
* (b) makes :class:`quantmla.QuantizedLatentCache` the cache ``generate`` builds for those models (where it would
  build a plain ``DynamicCache``), with the scheme and windows of ``QUANTMLA_HF_SCHEME`` (default ``c4r4``),
  ``QUANTMLA_HF_SINK`` / ``QUANTMLA_HF_RECENT`` (default 4 / 128; the tiny test sequences are shorter than 132
  tokens, so ``0`` / ``0`` is what exercises the quantised path) and a group size dividing the test models' latent
  and RoPE dims (``QUANTMLA_HF_GROUP``, default the largest of 64, 32, 16, 8 that does).

Tests deselected, each with its reason, are in :data:`SKIPS`; the run's header names the settings.
"""

from __future__ import annotations

import math
import os

import pytest
from transformers import DynamicCache, GenerationMixin, PreTrainedModel

from quantmla import QuantizedLatentCache, enable_latent_attention
from quantmla.models.latent import ATTN_IMPLEMENTATION

FAMILIES = ("deepseek_v2", "deepseek_v3")

#: test name (as pytest prints it, without the class) -> why it cannot pass under this plugin
SKIPS: dict[str, str] = {
    "test_sdpa_can_dispatch_non_composite_models": (
        "asserts that a model loaded without attn_implementation dispatches to 'sdpa'; this plugin exists to make "
        "every such model use 'quantmla_latent' (a test asking for an implementation by name gets it)"
    ),
    "test_generate_compile_model_forward_fullgraph": (
        "its eager half asserts that generate's default cache is a DynamicCache, the cache this plugin replaces "
        "with QuantizedLatentCache; its compiled half (cache_implementation='static', fullgraph, no recompiles, "
        "transformers' greedy tokens) runs on latent attention in tests/models/test_latent_attention.py"
    ),
}


def _settings() -> dict:
    return {
        "scheme": os.environ.get("QUANTMLA_HF_SCHEME", "c4r4"),
        "sink": int(os.environ.get("QUANTMLA_HF_SINK", "4")),
        "recent": int(os.environ.get("QUANTMLA_HF_RECENT", "128")),
        "group": os.environ.get("QUANTMLA_HF_GROUP"),
    }


def _group_size(config, asked: str | None) -> int:
    if asked:
        return int(asked)
    dims = math.gcd(config.kv_lora_rank, config.qk_rope_head_dim)
    return next(g for g in (64, 32, 16, 8, dims) if dims % g == 0)


def _is_family(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in FAMILIES


def _explicit_attention(config) -> str | None:
    """The attention implementation the model was built with, if asked for by name; ``None`` for transformers'
    default (``sdpa``: an explicit ``sdpa`` cannot be told from the default, and is switched too)."""
    impl = config._attn_implementation
    return None if impl in (None, "sdpa", ATTN_IMPLEMENTATION) else impl


def quantised_cache(model) -> QuantizedLatentCache:
    """The cache this plugin gives ``generate`` for ``model``."""
    s = _settings()
    config = model.config.get_text_config(decoder=True)
    return QuantizedLatentCache(config, scheme=s["scheme"], sink=s["sink"], recent=s["recent"],
                                group_size=_group_size(config, s["group"]))  # fmt: skip


def install():
    """Patch transformers (model construction and generate's cache); returns the function that undoes it."""
    post_init = PreTrainedModel.post_init
    prepare = GenerationMixin._prepare_cache_for_generation

    def latent_post_init(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        if not _is_family(self):
            return
        asked = _explicit_attention(self.config)
        enable_latent_attention(self)
        if asked is not None:  # installed, inactive: the implementation asked for by name runs
            self.set_attn_implementation(asked)

    def quantised_prepare(self, generation_config, model_kwargs, *args, **kwargs):
        out = prepare(self, generation_config, model_kwargs, *args, **kwargs)
        if not _is_family(self):
            return out
        for name in ("cache", "past_key_values"):
            built = model_kwargs.get(name)
            if type(built) is DynamicCache and not getattr(built, "_is_user_defined", False):
                cache = quantised_cache(self)
                if any(getattr(layer, "record_past", False) for layer in built.layers):
                    cache.activate_past_recording()  # e.g. an assistant's cache
                model_kwargs[name] = cache
        return out

    PreTrainedModel.post_init = latent_post_init
    GenerationMixin._prepare_cache_for_generation = quantised_prepare

    def undo() -> None:
        PreTrainedModel.post_init = post_init
        GenerationMixin._prepare_cache_for_generation = prepare

    return undo


def pytest_configure(config) -> None:
    install()


def pytest_report_header(config) -> str:
    s = _settings()
    return (f"quantmla_hf_suite: latent attention on DeepSeek-V2/V3 models; QuantizedLatentCache scheme {s['scheme']}, "
            f"sink {s['sink']}, recent {s['recent']}, group {s['group'] or 'auto'}")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        name = item.name.split("[")[0]
        if name in SKIPS:
            item.add_marker(pytest.mark.skip(reason=f"quantmla_hf_suite: {SKIPS[name]}"))
