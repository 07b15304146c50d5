"""Decode kernels. The Triton kernels import lazily: ``triton`` is an optional dependency on CPU."""

from quantmla.kernels.layout import NoKernelLayout, PagedLatentStore, PagedLayout
from quantmla.kernels.reference import mla_decode_reference

__all__ = ["NoKernelLayout", "PagedLatentStore", "PagedLayout", "mla_decode_reference"]
