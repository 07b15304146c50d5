from quantmla.cache.latent_cache import LatentCacheConfig, QuantizedLatentCache, QuantizedLatentLayer
from quantmla.cache.store import PathStore

__all__ = ["LatentCacheConfig", "PathStore", "QuantizedLatentCache", "QuantizedLatentLayer"]
