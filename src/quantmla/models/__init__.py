from quantmla.models import families  # noqa: F401  (registers the adapters)
from quantmla.models.adapter import MLAAdapter, MLADims, RopeLayout, get_adapter, register_adapter
from quantmla.models.latent import (
    ATTN_IMPLEMENTATION,
    disable_latent_attention,
    enable_latent_attention,
    is_latent_attention_enabled,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MLAAdapter",
    "MLADims",
    "RopeLayout",
    "disable_latent_attention",
    "enable_latent_attention",
    "get_adapter",
    "is_latent_attention_enabled",
    "register_adapter",
]
