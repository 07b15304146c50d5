"""The vLLM versions, platforms and GPUs the plugin supports, and one clear error for the others."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.quantmla")  # under vLLM's logger: its handler prints it

#: (vLLM major.minor, platform) pairs the plugin is built and tested against (CUDA: FLASH_ATTN_MLA); a new version
#: joins once its GPU tests have run (``scripts/serving_gpu.sh`` with ``TRIAL_VLLM=X.Y`` lists it on the device's copy
#: of the tree for those runs)
SUPPORTED = (("0.32", "cpu"), ("0.26", "cuda"), ("0.33", "cuda"))
#: vLLM versions on which speculative decoding through quantmla's cache has not yet run on a GPU (its test, DeepSeek's
#: MTP in ``tests/serving/test_vllm_gpu.py``): refused there at engine start (``TRIAL_SPEC=1`` allows it in the GPU
#: machine's copy for that test)
SPECULATIVE_UNTESTED = ("0.33",)
#: the CUDA compute capability its kernels are built and tested for (Hopper)
CUDA_CAPABILITY = (9, 0)


def _describe() -> str:
    return ", ".join(f"vLLM {v} on {p}" for v, p in SUPPORTED)


def minor(version: str) -> str:
    """``major.minor`` of a version string."""
    return ".".join(version.split(".")[:2])


def unsupported(version: str, platform: str, capability: tuple[int, int] | None) -> str | None:
    """Why this vLLM, platform and GPU cannot run the plugin, or ``None`` when they can."""
    short = minor(version)
    if (short, platform) not in SUPPORTED:
        return f"quantmla's vLLM plugin supports {_describe()}; this is vLLM {version} on {platform}"
    if platform == "cuda" and capability is not None and tuple(capability) != CUDA_CAPABILITY:
        want = "sm_{}{}".format(*CUDA_CAPABILITY)
        return (f"quantmla's vLLM plugin runs on {want} (Hopper) GPUs; this GPU is sm_{capability[0]}{capability[1]}:"
                " serve without quantmla's scheme, or on an H100/H200")  # fmt: skip
    return None


def check_supported(asked: bool) -> str | None:
    """The platform name if this vLLM, platform and GPU are supported; otherwise ``None`` (the plugin not asked
    for: vLLM runs as without it) or a ``RuntimeError`` saying what is supported (asked for)."""
    import vllm
    from vllm.platforms import current_platform

    platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"
    capability = None
    if platform == "cuda":
        cap = current_platform.get_device_capability()
        capability = None if cap is None else (cap.major, cap.minor) if hasattr(cap, "major") else tuple(cap)
    why = unsupported(vllm.__version__, platform, capability)
    if why is None:
        return platform
    if asked:
        raise RuntimeError(why)
    logger.warning("%s: the plugin stays inactive", why)
    return None
