"""quantmla: small and fast low-bit KV caches for Multi-Head Latent Attention models."""

from quantmla.cache import QuantizedLatentCache
from quantmla.calibrate import calibrate_model, export
from quantmla.models import disable_latent_attention, enable_latent_attention, get_adapter
from quantmla.models.loading import load
from quantmla.quant import parse_scheme

__version__ = "0.1.0"

__all__ = [
    "QuantizedLatentCache",
    "__version__",
    "calibrate_model",
    "export",
    "disable_latent_attention",
    "enable_latent_attention",
    "get_adapter",
    "load",
    "parse_scheme",
]
