"""quantmla: small and fast low-bit KV caches for Multi-Head Latent Attention models.

The public names load lazily, on first use: ``import quantmla`` (and the vLLM entry point
:func:`quantmla.serving.vllm.register`, which vLLM imports in every process) loads none of the cache,
calibration or model code until one of them is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC = {
    "QuantizedLatentCache": "quantmla.cache",
    "calibrate_model": "quantmla.calibrate",
    "export": "quantmla.calibrate",
    "disable_latent_attention": "quantmla.models",
    "enable_latent_attention": "quantmla.models",
    "get_adapter": "quantmla.models",
    "load": "quantmla.models.loading",
    "parse_scheme": "quantmla.formats",
}

__all__ = [
    "QuantizedLatentCache",
    "__version__",
    "calibrate_model",
    "disable_latent_attention",
    "enable_latent_attention",
    "export",
    "get_adapter",
    "load",
    "parse_scheme",
]

if TYPE_CHECKING:
    from quantmla.cache import QuantizedLatentCache
    from quantmla.calibrate import calibrate_model, export
    from quantmla.formats import parse_scheme
    from quantmla.models import disable_latent_attention, enable_latent_attention, get_adapter
    from quantmla.models.loading import load


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'quantmla' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
