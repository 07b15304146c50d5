"""quantmla's Hopper (sm_90a) CUDA extensions: JIT-built from the sources beside this file by
``torch.utils.cpp_extension`` (cached per machine), loaded on first use.

They need an sm_90 device and nvcc (CUDA 12.3 or later for the sm_90a features). Where a piece is missing,
:func:`extension` raises :class:`HopperUnavailable` naming it; callers warn once and take the Triton path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCES = Path(__file__).parent
#: extension name -> its CUDA sources (the torch binding ``binding.cpp`` is built with each)
EXTENSIONS = {"v3": ("fragment_probe.cu", "tile_h16.cu", "stream_h16.cu", "stream_h16_cs.cu")}
CUDA_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--use_fast_math")


class HopperUnavailable(RuntimeError):
    """A Hopper extension cannot be built or run here; the message names what is missing."""


def missing() -> str | None:
    """What this machine lacks for the Hopper extensions (``None``: nothing)."""
    if not torch.cuda.is_available():
        return "a CUDA device (torch sees none)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"an sm_90 device (this one is sm_{major}{minor})"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "nvcc (CUDA_HOME is not set and nvcc is not on PATH)"
    return None


@functools.cache
def extension(name: str):
    """The built and loaded extension ``name`` (one of :data:`EXTENSIONS`)."""
    if name not in EXTENSIONS:
        raise ValueError(f"unknown Hopper extension {name!r}; valid: {', '.join(EXTENSIONS)}")
    reason = missing()
    if reason is not None:
        raise HopperUnavailable(f"quantmla's Hopper kernels need {reason}")
    from torch.utils.cpp_extension import load

    sources = [str(SOURCES / "binding.cpp"), *(str(SOURCES / s) for s in EXTENSIONS[name])]
    logger.info("building (or loading the cached build of) the Hopper extension %s from %s", name, SOURCES)
    return load(name=f"quantmla_{name}", sources=sources, extra_cuda_cflags=list(CUDA_FLAGS), verbose=False)
