"""The sm_90a decode extension (``csrc/`` beside this file): JIT-built by ``torch.utils.cpp_extension`` for
``sm_90a`` on first use, cached per machine and torch version, loaded once per process.

It needs an sm_90 GPU (H100, H200), nvcc (CUDA 12.3 or later: ``wgmma``, ``setmaxnreg``) and ninja
(``pip install "quantmla[hopper]"`` brings ninja). Where a piece is missing or the build fails,
:func:`extension` raises :class:`HopperUnavailable` naming it; :func:`quantmla.kernels.decode.mla_decode`
then warns once and decodes with its Triton kernel (the same arithmetic: fp16 operands, fp32 accumulation).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("binding.cpp", "decode_sm90.cu")
HEADERS = ("decode_sm90.h", "sm90_ops.cuh", "wgmma_ops.cuh")
#: no language standard: torch's extension builder sets the one its headers need (C++20 from torch 2.14)
CUDA_FLAGS = ("-O3", "-gencode=arch=compute_90a,code=sm_90a")


class HopperUnavailable(RuntimeError):
    """The sm_90a decode cannot be built or run here; the message names what is missing."""


@functools.cache
def missing(device: torch.device | None = None) -> str | None:
    """What this machine lacks for the sm_90a decode (``None``: nothing); checked once a device and process."""
    if not torch.cuda.is_available():
        return "a CUDA device (torch sees none)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"an sm_90 GPU (this one is sm_{major}{minor})"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "nvcc (CUDA_HOME is not set and nvcc is not on PATH)"
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return "ninja (pip install ninja, or quantmla[hopper])"
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return None


def source_key() -> str:
    """A short hash of the sources and torch's version: a changed source builds anew instead of loading a stale
    build from the cache."""
    h = hashlib.sha1(torch.__version__.encode())
    for name in (*SOURCES, *HEADERS):
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:10]


def extension():
    """The built and loaded extension (raises :class:`HopperUnavailable`; a failed build is not retried)."""
    ext, error = _build()
    if error is not None:
        raise error
    return ext


@functools.cache
def _build():
    """``(extension, None)``, or ``(None, HopperUnavailable)``: one attempt a process."""
    reason = missing()
    if reason is not None:
        return None, HopperUnavailable(f"quantmla's sm_90a decode needs {reason}")
    from torch.utils.cpp_extension import load

    name = f"quantmla_sm90_decode_{source_key()}"
    logger.info("building (or loading the cached build of) quantmla's sm_90a decode %s from %s", name, CSRC)
    try:
        return load(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cuda_cflags=list(CUDA_FLAGS),
                    extra_include_paths=[str(CSRC)], verbose=False), None  # fmt: skip
    except Exception as e:  # a compiler error: say which, keep the Triton path
        return None, HopperUnavailable(f"a working build ({type(e).__name__}: {str(e).splitlines()[-1][:300]})")
