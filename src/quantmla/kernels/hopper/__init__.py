"""quantmla's Hopper (sm_90a) decode kernel for 64 to 128 query rows a sequence: FlashMLA's dense schedule
(two consumer warpgroups, the "seesaw") fed by a warpgroup that dequantises the low-bit pages into fp16
tiles in shared memory. CUDA C++ in ``csrc/``, JIT-built on first use (:mod:`.build`); :mod:`.launch` runs it
for :func:`quantmla.kernels.decode.mla_decode`. Its shared-memory arithmetic is modelled in Python for the CPU tests
(``tests/kernels/sm90_tile.py``)."""

from quantmla.kernels.hopper.build import HopperUnavailable, extension, missing
from quantmla.kernels.hopper.launch import SM90_ROWS, page_splits, query_reason, unsupported

__all__ = ["SM90_ROWS", "HopperUnavailable", "extension", "missing", "page_splits", "query_reason", "unsupported"]
