"""The fused CPU decode extension (``paged_decode.cpp`` beside this file): JIT-built by
``torch.utils.cpp_extension`` for this machine's CPU (``-O3 -march=native``), cached per machine, loaded on
first use.

It needs a C++ compiler and ninja (``pip install "quantmla[cpu]"`` brings ninja). Where one is missing or the
build fails, :func:`extension` raises :class:`CPUExtensionUnavailable` naming it; the caller logs it once and
decodes with the torch path (the same float32 arithmetic, summed in another order: results agree to ~1e-6).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "paged_decode.cpp"
#: the language standard is left to torch's extension builder: it builds against its own headers, which need C++20
#: from torch 2.14 (a C++17 flag of ours, given after torch's, breaks that build)
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd")


class CPUExtensionUnavailable(RuntimeError):
    """The fused CPU decode cannot be built or loaded here; the message names what is missing."""


def _cpu_key() -> str:
    """A short key of this CPU's model and flags and of torch's version: the build is ``-march=native`` against
    this torch, so a cache shared by different CPUs or environments keeps one build each."""
    import torch

    info = torch.__version__ + (platform.processor() or platform.machine())
    try:
        text = Path("/proc/cpuinfo").read_text()
        info += next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
        info += next((line for line in text.splitlines() if line.startswith("model name")), "")
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:10]


def _ensure_ninja() -> None:
    if shutil.which("ninja"):
        return
    try:  # the PyPI wheel keeps its binary beside the package; torch looks on PATH
        import ninja
    except ImportError:
        raise CPUExtensionUnavailable("ninja (pip install ninja, or quantmla[cpu])") from None
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def extension():
    """The built and loaded extension (raises :class:`CPUExtensionUnavailable`)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise CPUExtensionUnavailable(f"a C++ compiler ({cxx!r} is not on PATH)")
    _ensure_ninja()
    from torch.utils.cpp_extension import load

    name = f"quantmla_cpu_decode_{_cpu_key()}"
    logger.info("building (or loading the cached build of) quantmla's fused CPU decode %s from %s", name, SOURCE)
    try:
        return load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS), verbose=False)
    except Exception as e:  # a compiler error: say which, keep the torch path
        raise CPUExtensionUnavailable(f"a working build ({type(e).__name__}: {str(e).splitlines()[-1][:200]})") from e
