"""Packed storage of one cached path (content latent or RoPE key) for a batch of sequences.

Tokens are quantised once, when they are appended, and kept in the path's stored fields
(:class:`~quantmla.formats.paths.PathLayout`: the same bytes a record or a kernel page holds), one uint8
array ``[batch, capacity, nbytes]`` a field. Capacity grows in whole pages of ``page_size`` tokens, so the
allocated bytes are what :meth:`PathStore.nbytes` reports.
"""

from __future__ import annotations

import torch

from quantmla.formats.codec import PathCodec
from quantmla.formats.paths import PathLayout
from quantmla.formats.scheme import PathFormat
from quantmla.quant.ranged import check_ranges


class PathStore:
    def __init__(
        self,
        fmt: PathFormat,
        dim: int,
        group_size: int,
        batch: int,
        hp_dtype: torch.dtype,
        device: torch.device,
        page_size: int = 64,
        ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
        path: str = "c",
    ) -> None:
        """``ranges``: learned threshold ratios and gains per group (:mod:`~quantmla.quant.ranged`), used when
        a token is written; the storage is the plain affine format's. ``path``: ``"c"`` (content latent) or
        ``"r"`` (RoPE key), the path's place in a record (its group-planar words)."""
        if fmt.page is not None:
            raise ValueError(f"the per-channel-in-page format {fmt.spec!r} is held by PagedPathStore")
        if fmt.channel_bits is not None and len(fmt.channel_bits) != dim:
            raise ValueError(f"{len(fmt.channel_bits)} channel widths for a path of {dim} channels")
        self.layout = PathLayout(fmt, dim, group_size, path, hp_dtype)
        if ranges is not None:
            PathCodec(fmt, clip_ratio=ranges[0], gain=ranges[1])  # the format takes learned ranges
            check_ranges(*ranges, dim // self.layout.group_size)
        self.ranges = ranges
        self.fmt, self.dim, self.group_size, self.page_size = fmt, dim, self.layout.group_size, page_size
        self.batch, self.hp_dtype, self.device = batch, hp_dtype, device
        self.length = 0
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.empty(batch, 0, n, dtype=torch.uint8, device=device) for name, n in self.layout.fields
        }

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[1]

    def append(self, x: torch.Tensor, check: bool = True) -> None:
        """Quantise and store ``x`` of shape ``[batch, n, dim]``. ``check``: reject values the format
        cannot hold (non-finite, beyond fp16 for integer codes); it reads values back to the host (a GPU
        sync), so a caller that checked ``x`` before passes ``False``."""
        n = x.shape[1]
        if n == 0:
            return
        need = self.length + n
        if need > self.capacity:
            cap = -(-need // self.page_size) * self.page_size
            for name, t in self.tensors.items():
                grown = torch.empty(self.batch, cap, t.shape[-1], dtype=t.dtype, device=t.device)
                grown[:, : self.length] = t[:, : self.length]
                self.tensors[name] = grown
        for t, v in zip(self.tensors.values(), self.layout.encode(x, check, self.ranges), strict=True):
            t[:, self.length : need] = v
        self.length = need

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.layout.decode([t[:, : self.length] for t in self.tensors.values()], dtype)

    # -- rollback (speculative decoding): every token is quantised on its own, so a prefix is exact ----------
    def set_recording(self, on: bool) -> None:
        """Start (or stop) keeping what :meth:`truncate` needs: nothing, for a per-token format."""

    def truncation_error(self, length: int) -> str | None:
        """Why :meth:`truncate` to ``length`` could not be exact (``None``: it can)."""
        return None

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens, exactly as a store that never saw the rest (its pages too)."""
        if length >= self.length:
            return
        self.length = length
        cap = -(-length // self.page_size) * self.page_size
        if cap < self.capacity:
            self.tensors = {k: t[:, :cap].clone() for k, t in self.tensors.items()}

    def nbytes(self) -> int:
        """Bytes of the allocated arrays (whole pages)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (e.g. an ``index_select`` on dim 0) to every stored tensor."""
        self.tensors = {k: fn(v) for k, v in self.tensors.items()}
        self.batch = next(iter(self.tensors.values())).shape[0]


class TransformedStore:
    """A store of the path in its write-side transform's space (:class:`~quantmla.formats.codec.PathCodec`):
    tokens are appended as ``x A`` and read back as ``Q(x A) A^-1`` (the torch path dequantises and maps
    back; a kernel would instead read with ``A^-1`` fused into the weights and the query). Same interface."""

    def __init__(self, inner, path: PathCodec) -> None:
        if path.transform is None:
            raise ValueError("TransformedStore needs a path codec with a write-side transform")
        self.inner, self.path = inner, path

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def batch(self) -> int:
        return self.inner.batch

    def append(self, x: torch.Tensor, check: bool = True) -> None:
        self.inner.append(self.path.forward(x.to(torch.promote_types(x.dtype, torch.float32))), check)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.path.backward(self.inner.dequantize(torch.promote_types(dtype, torch.float32))).to(dtype)

    def set_recording(self, on: bool) -> None:
        self.inner.set_recording(on)

    def truncation_error(self, length: int) -> str | None:
        return self.inner.truncation_error(length)

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def map_batch(self, fn) -> None:
        self.inner.map_batch(fn)
