"""Hopper (sm_90a) CUDA kernels of the decode kernel v3 (issue 19): built on first use, see :mod:`.build`."""

from kernel_v3.hopper.build import HopperUnavailable, extension, missing

__all__ = ["HopperUnavailable", "extension", "missing"]
