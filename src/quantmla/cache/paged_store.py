"""Per-channel-within-page storage of one cached path (RAQ-MLA's RoPE key, KIVI-style keys).

Tokens arrive in order (the cache's middle: those that left the recent window). Every ``P`` of them form
a page; once a page is full it is quantised per channel (:func:`~quantmla.quant.channel.quantize_per_channel`:
fp16 scale and minimum per channel and page, codes bit-packed per token). The tokens of the page still
filling are kept as computed, in a buffer of ``P`` rows. Storage: ``d * bits / 8`` bytes a token, ``4 d``
bytes a page, and the buffer; :meth:`PagedPathStore.nbytes` reports what is allocated.
"""

from __future__ import annotations

import torch

from quantmla.formats.packing import pack_codes, pack_mixed, packed_bytes, unpack_codes, unpack_mixed
from quantmla.formats.scheme import PathFormat
from quantmla.quant.affine import GroupQuantized, check_quantizable
from quantmla.quant.channel import dequantize_per_channel, quantize_per_channel
from quantmla.quant.mixed import dequantize_channels_mixed, quantize_channels_mixed


class PagedPathStore:
    """Same interface as :class:`~quantmla.cache.store.PathStore` (``append``, ``dequantize``, ``nbytes``,
    ``map_batch``, ``length``), for a format with ``page`` set."""

    def __init__(
        self,
        fmt: PathFormat,
        dim: int,
        batch: int,
        hp_dtype: torch.dtype,
        device: torch.device,
        page_size: int = 64,
    ) -> None:
        if fmt.page is None or fmt.kind != "int":
            raise ValueError(f"PagedPathStore holds per-channel-in-page integer formats, not {fmt}")
        self.fmt, self.dim, self.page, self.batch = fmt, dim, fmt.page, batch
        self.hp_dtype, self.device = hp_dtype, device
        self.grow_pages = max(1, page_size // fmt.page)  # allocation granularity, in pages
        self.full = 0  # whole pages stored
        self.fill = 0  # tokens in the page still filling
        b, p = batch, fmt.page
        self.tensors: dict[str, torch.Tensor] = {
            "codes": torch.empty(b, 0, self._code_bytes(), dtype=torch.uint8, device=device),
            "scale": torch.empty(b, 0, dim, dtype=torch.float16, device=device),
            "minimum": torch.empty(b, 0, dim, dtype=torch.float16, device=device),
            "filling": torch.empty(b, p, dim, dtype=hp_dtype, device=device),
        }
        #: while recording (:meth:`set_recording`): the tokens of the pages quantised since, as they were before
        #: quantisation (the last ``retained.shape[1]`` tokens of the whole pages), so :meth:`truncate` can put a
        #: page back into the filling buffer
        self.retained: torch.Tensor | None = None

    def _code_bytes(self) -> int:
        bits = self.fmt.channel_bits
        return packed_bytes(bits) if bits is not None else self.dim * self.fmt.bits // 8

    @property
    def length(self) -> int:
        return self.full * self.page + self.fill

    def _grow(self, pages: int) -> None:
        have = self.tensors["scale"].shape[1]
        if pages <= have:
            return
        cap = -(-pages // self.grow_pages) * self.grow_pages
        for name, per in (("codes", self.page), ("scale", 1), ("minimum", 1)):
            t = self.tensors[name]
            grown = torch.empty(self.batch, cap * per, t.shape[-1], dtype=t.dtype, device=t.device)
            grown[:, : self.full * per] = t[:, : self.full * per]
            self.tensors[name] = grown

    def append(self, x: torch.Tensor, check: bool = True) -> None:
        """Store ``x [batch, n, dim]``: whole pages quantised, the rest kept as computed until its page fills."""
        n = x.shape[1]
        if n == 0:
            return
        if check:
            check_quantizable(x, "x")
        p = self.page
        pending = torch.cat([self.tensors["filling"][:, : self.fill].to(x.dtype), x], dim=1)
        pages = pending.shape[1] // p
        if pages:
            bits = self.fmt.channel_bits
            self._grow(self.full + pages)
            t0, t1 = self.full * p, (self.full + pages) * p
            if bits is not None:  # "scale" holds the span: each channel's step is span / (2**bits - 1)
                q = quantize_channels_mixed(pending[:, : pages * p], bits, p, check=False)
                self.tensors["codes"][:, t0:t1] = pack_mixed(q.codes, bits)
                q_scale = q.span
            else:
                q = quantize_per_channel(pending[:, : pages * p], self.fmt.bits, p, check=False)
                self.tensors["codes"][:, t0:t1] = pack_codes(q.codes, self.fmt.bits)
                q_scale = q.scale
            self.tensors["scale"][:, self.full : self.full + pages] = q_scale
            self.tensors["minimum"][:, self.full : self.full + pages] = q.minimum
            self.full += pages
            if self.retained is not None:
                self.retained = torch.cat([self.retained.to(pending.dtype), pending[:, : pages * p]], dim=1)
        rest = pending[:, pages * p :]
        self.tensors["filling"][:, : rest.shape[1]] = rest.to(self.hp_dtype)
        self.fill = rest.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        p, t, bits = self.page, self.full * self.page, self.fmt.channel_bits
        scale, minimum = self.tensors["scale"][:, : self.full], self.tensors["minimum"][:, : self.full]
        if bits is not None:
            codes = unpack_mixed(self.tensors["codes"][:, :t], bits)
            stored = dequantize_channels_mixed(codes, minimum, scale, bits, p, dtype)
        else:
            codes = unpack_codes(self.tensors["codes"][:, :t], self.fmt.bits, self.dim)
            stored = dequantize_per_channel(GroupQuantized(codes, scale, minimum, self.fmt.bits, p), dtype)
        return torch.cat([stored, self.tensors["filling"][:, : self.fill].to(dtype)], dim=1)

    # -- rollback (speculative decoding) ---------------------------------------------------------------
    def set_recording(self, on: bool) -> None:
        """Start keeping the unquantised tokens of the pages filled from now on (``on``), or stop; either way
        forget those kept so far."""
        self.retained = torch.empty(self.batch, 0, self.dim, dtype=self.hp_dtype, device=self.device) if on else None

    def truncation_error(self, length: int) -> str | None:
        """Why :meth:`truncate` to ``length`` could not be exact (``None``: it can): a page quantised before
        recording started would have to be split."""
        keep_full = length // self.page
        if length >= self.length or keep_full >= self.full or length % self.page == 0:
            return None
        kept = 0 if self.retained is None else self.retained.shape[1]
        if keep_full * self.page >= self.full * self.page - kept:
            return None
        return (f"token {length} lies in a page of {self.page} quantised per channel before past recording started "
                f"(its unquantised tokens are gone)")  # fmt: skip

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens exactly as a store that never saw the rest: a quantised page that is
        cut goes back to the filling buffer unquantised (see :meth:`truncation_error`)."""
        if length >= self.length:
            return
        why = self.truncation_error(length)
        if why is not None:
            raise RuntimeError(f"cannot truncate to {length} tokens: {why}")
        p, keep_full = self.page, length // self.page
        fill = length - keep_full * p
        if keep_full < self.full:
            dropped = (self.full - keep_full) * p  # tokens of the quantised pages given up
            if self.retained is not None:
                tail = self.retained[:, self.retained.shape[1] - dropped :]
                self.retained = self.retained[:, : self.retained.shape[1] - dropped]
                self.tensors["filling"][:, :fill] = tail[:, :fill].to(self.hp_dtype)
            self.full = keep_full
            cap = -(-keep_full // self.grow_pages) * self.grow_pages
            for name, per in (("codes", p), ("scale", 1), ("minimum", 1)):
                self.tensors[name] = self.tensors[name][:, : cap * per].clone()
        self.fill = fill

    def nbytes(self) -> int:
        """Bytes of the allocated arrays (whole allocation units of pages, and the filling page's buffer)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def map_batch(self, fn) -> None:
        self.tensors = {k: fn(v) for k, v in self.tensors.items()}
        self.batch = self.tensors["scale"].shape[0]
        if self.retained is not None:
            self.retained = fn(self.retained)
