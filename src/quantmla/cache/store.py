"""Packed storage of one cached path (content latent or RoPE key) for a batch of sequences.

Tokens are quantised once, when they are appended, and kept packed: integer codes bit-packed into
uint8 with fp16 scale/minimum per group (TQ-MSE: an fp16 norm per width group), or FP8 e4m3 with a
float32 power-of-two scale per 128 values, or the unquantised values. Capacity grows in whole pages of
``page_size`` tokens, so the allocated bytes are what :meth:`PathStore.nbytes` reports.
"""

from __future__ import annotations

import torch

from quantmla.quant.affine import dequantize_groups, quantize_groups
from quantmla.quant.clip import quantize_clipped
from quantmla.quant.codec import PathCodec
from quantmla.quant.fp8 import FP8_TILE, dequantize_fp8, quantize_fp8
from quantmla.quant.mixed import dequantize_mixed, pack_mixed, packed_bytes, quantize_mixed, unpack_mixed
from quantmla.quant.packing import pack_codes, unpack_codes
from quantmla.quant.ranged import check_ranges, quantize_ranged
from quantmla.quant.scheme import PathFormat
from quantmla.quant.turbo import dequantize_turbo, quantize_turbo, width_groups


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
    ) -> None:
        """``ranges``: learned threshold ratios and gains per group (:mod:`~quantmla.quant.ranged`), used when
        a token is written; the storage is the plain affine format's."""
        if fmt.page is not None:
            raise ValueError(f"the per-channel-in-page format {fmt.spec!r} is held by PagedPathStore")
        if ranges is not None:
            PathCodec(fmt, clip_ratio=ranges[0], gain=ranges[1])  # the format takes learned ranges
            check_ranges(*ranges, dim // fmt.group_size(group_size))
        self.ranges = ranges
        if fmt.channel_bits is not None and len(fmt.channel_bits) != dim:
            raise ValueError(f"{len(fmt.channel_bits)} channel widths for a path of {dim} channels")
        group_size = fmt.group_size(group_size)  # the path's own group, if it has one
        self.fmt, self.dim, self.group_size, self.page_size = fmt, dim, group_size, page_size
        self.batch, self.hp_dtype, self.device = batch, hp_dtype, device
        self.length = 0
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.empty(batch, 0, width, dtype=dt, device=device) for name, (width, dt) in self._fields().items()
        }

    def _fields(self) -> dict[str, tuple[int, torch.dtype]]:
        d = self.dim
        if self.fmt.kind == "bf16":
            return {"values": (d, self.hp_dtype)}
        if self.fmt.kind == "fp8":
            return {"values": (d, torch.float8_e4m3fn), "scale": (d // FP8_TILE, torch.float32)}
        if self.fmt.turbo:
            bits = self.fmt.widths(d)
            return {"codes": (packed_bytes(bits), torch.uint8), "norms": (len(width_groups(bits)), torch.float16)}
        g = d // self.group_size
        if self.fmt.channel_bits is not None:
            bits = self.fmt.channel_bits
            return {
                "codes": (packed_bytes(bits), torch.uint8),
                "minimum": (g, torch.float16),
                "span": (g, torch.float16),
            }
        return {
            "codes": (d * self.fmt.bits // 8, torch.uint8),
            "scale": (g, torch.float16),
            "minimum": (g, torch.float16),
        }

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[1]

    def _encode(self, x: torch.Tensor, check: bool) -> dict[str, torch.Tensor]:
        if self.fmt.kind == "bf16":
            return {"values": x.to(self.hp_dtype)}
        if self.fmt.kind == "fp8":
            q = quantize_fp8(x, check=check)
            return {"values": q.values, "scale": q.scale}
        if self.fmt.turbo:
            q = quantize_turbo(x, self.fmt.widths(self.dim), check=check)
            return {"codes": pack_mixed(q.codes, q.channel_bits), "norms": q.norms}
        if self.fmt.channel_bits is not None:
            m = quantize_mixed(x, self.fmt.channel_bits, self.group_size, check=check)
            return {"codes": pack_mixed(m.codes, m.bits), "minimum": m.minimum, "span": m.span}
        if self.ranges is not None:
            q = quantize_ranged(x, self.fmt.bits, self.group_size, *self.ranges, check=check)
        elif self.fmt.clip is not None:
            q = quantize_clipped(x, self.fmt.bits, self.group_size, self.fmt.clip, check=check)
        else:
            q = quantize_groups(x, self.fmt.bits, self.group_size, check=check)
        return {"codes": pack_codes(q.codes, self.fmt.bits), "scale": q.scale, "minimum": q.minimum}

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
        for name, v in self._encode(x, check).items():
            self.tensors[name][:, self.length : need] = v
        self.length = need

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        t = {k: v[:, : self.length] for k, v in self.tensors.items()}
        if self.fmt.kind == "bf16":
            return t["values"].to(dtype)
        if self.fmt.kind == "fp8":
            return dequantize_fp8(t["values"], t["scale"], FP8_TILE, dtype)
        if self.fmt.turbo:
            bits = self.fmt.widths(self.dim)
            return dequantize_turbo(unpack_mixed(t["codes"], bits), t["norms"], bits, dtype)
        if self.fmt.channel_bits is not None:
            bits = self.fmt.channel_bits
            return dequantize_mixed(
                unpack_mixed(t["codes"], bits), t["minimum"], t["span"], bits, self.group_size, dtype
            )
        codes = unpack_codes(t["codes"], self.fmt.bits, self.dim)
        return dequantize_groups(codes, t["scale"], t["minimum"], self.group_size, dtype)

    def nbytes(self) -> int:
        """Bytes of the allocated arrays (whole pages)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (e.g. an ``index_select`` on dim 0) to every stored tensor."""
        self.tensors = {k: fn(v) for k, v in self.tensors.items()}
        self.batch = next(iter(self.tensors.values())).shape[0]


class TransformedStore:
    """A store of the path in its write-side transform's space (:class:`~quantmla.quant.codec.PathCodec`):
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

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def map_batch(self, fn) -> None:
        self.inner.map_batch(fn)
