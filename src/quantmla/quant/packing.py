"""Bit packing of integer codes into uint8 storage.

``bits`` codes of ``b`` bits each are packed little-endian into a bit stream: eight codes occupy
exactly ``b`` bytes, so any ``b`` in 1..8 packs without padding as long as the last dimension is a
multiple of eight. Packing and unpacking are exact inverses on codes in ``[0, 2**b)``.
"""

from __future__ import annotations

import torch

SUPPORTED_PACK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_PACK_BITS:
        raise ValueError(f"bits={bits!r} cannot be packed; valid: {SUPPORTED_PACK_BITS}")


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits (``n`` must be a multiple of 8)."""
    _check_bits(bits)
    if n % 8:
        raise ValueError(f"the number of codes ({n}) must be a multiple of 8 to pack without padding")
    return n * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (last dim a multiple of 8) into uint8, ``bits`` bits per code."""
    _check_bits(bits)
    n = codes.shape[-1]
    packed_size(n, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits in (2, 4):  # fast path: codes never straddle a byte
        per = 8 // bits
        c = codes.to(torch.uint8).reshape(*codes.shape[:-1], n // per, per)
        out = c[..., 0].clone()
        for i in range(1, per):
            out |= c[..., i] << (bits * i)
        return out
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], n // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1)  # 8*bits <= 64 bits, disjoint fields, so sum == bitwise or
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.to(torch.uint8).reshape(*codes.shape[:-1], n * bits // 8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: returns ``n`` codes per row as uint8."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed storage must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(f"packed last dim {packed.shape[-1]} does not hold {n} codes of {bits} bits")
    if bits == 8:
        return packed.clone()
    mask = (1 << bits) - 1
    if bits in (2, 4):
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
        out = (packed.unsqueeze(-1) >> shifts) & mask
        return out.reshape(*packed.shape[:-1], n)
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], n // 8, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    out = (word.unsqueeze(-1) >> shifts) & mask
    return out.to(torch.uint8).reshape(*packed.shape[:-1], n)
