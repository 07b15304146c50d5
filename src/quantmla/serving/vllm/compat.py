"""The vLLM versions and platforms the plugin supports, and one clear error for the others."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it

#: (vLLM major.minor, platform) pairs the plugin is built and tested against (CUDA: sm_90, FLASH_ATTN_MLA)
SUPPORTED = (("0.32", "cpu"), ("0.26", "cuda"))


def _describe() -> str:
    return ", ".join(f"vLLM {v} on {p}" for v, p in SUPPORTED)


def check_supported(asked: bool) -> str | None:
    """The platform name if this vLLM is supported; otherwise ``None`` (plugin not asked for: vLLM runs as
    without it) or a ``RuntimeError`` naming the supported versions (asked for)."""
    import vllm
    from vllm.platforms import current_platform

    version = ".".join(vllm.__version__.split(".")[:2])
    platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"
    if (version, platform) in SUPPORTED:
        return platform
    msg = f"quantmla's vLLM plugin supports {_describe()}; this is vLLM {vllm.__version__} on {platform}"
    if asked:
        raise RuntimeError(msg)
    # additional_config and quantmla.json are not visible yet when plugins load: say once that they would be ignored
    logger.warning("%s: the plugin stays inactive (an additional_config['quantmla'] or quantmla.json is ignored)", msg)
    return None
