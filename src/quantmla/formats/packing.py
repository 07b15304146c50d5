"""Bit packing of integer codes into uint8 storage: every packed layout the cache, the kernels and the
engines' pages use, each with its exact inverse on codes in ``[0, 2**b)``.

* **Bit stream** (:func:`pack_codes`): codes of ``b`` bits packed little-endian, eight codes in exactly
  ``b`` bytes, so any ``b`` in 1..8 packs without padding when the last dimension is a multiple of eight.
* **Group-planar words** (:func:`pack_words`), the 2- and 4-bit layout the decode kernels read: a path of
  ``d`` channels is cut into ``planes`` runs of ``d / planes`` channels (:data:`CONTENT_PLANES` for the
  content latent, :data:`ROPE_PLANES` for the RoPE key); a little-endian word of ``planes * bits`` bits
  holds one code of every run (code ``k`` of word ``e`` is channel ``k * d / planes + e``, at bit
  ``k * bits``). The kernels turn a pair of words into one fp16 pair per run with a few bit operations
  (:mod:`quantmla.kernels.unpack`), and each run is a contiguous channel slice.
* **Mixed widths** (:func:`pack_mixed`): one width per channel, one bit stream per token, channel after
  channel, padded to a byte.
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


#: planes of the group-planar layout: the content latent's words hold 8 codes, the RoPE key's 4
CONTENT_PLANES = 8
ROPE_PLANES = 4


def planes_of(path: str) -> int:
    """The group-planar planes of a cached path: ``"c"`` (content latent) or ``"r"`` (RoPE key)."""
    if path not in ("c", "r"):
        raise ValueError(f"path {path!r}; valid: c (content latent), r (RoPE key)")
    return CONTENT_PLANES if path == "c" else ROPE_PLANES


def pack_words(codes: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """Group-planar packing of ``codes`` (last dim ``d``) into little-endian bytes
    ``[..., d * bits / 8]``: word ``e`` (``planes * bits`` bits) holds channel ``k * d / planes + e``
    at bit ``k * bits``, for ``k < planes``."""
    word_bits = planes * bits
    if bits not in (2, 4) or word_bits not in (16, 32):
        raise ValueError(f"bits={bits}, planes={planes}: words must be 16 or 32 bits of 2- or 4-bit codes")
    d = codes.shape[-1]
    if d % planes:
        raise ValueError(f"{d} channels do not split into {planes} planes")
    runs = codes.to(torch.int64).reshape(*codes.shape[:-1], planes, d // planes)
    words = torch.zeros_like(runs[..., 0, :])
    for k in range(planes):
        words |= runs[..., k, :] << (bits * k)
    nbytes = word_bits // 8
    out = torch.stack([(words >> (8 * i)) & 255 for i in range(nbytes)], dim=-1)  # little-endian
    return out.flatten(-2).to(torch.uint8)


def unpack_words(packed: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: codes ``[..., d]`` (uint8), through int64 words (the reference)."""
    nbytes = planes * bits // 8
    by = packed.to(torch.int64).unflatten(-1, (-1, nbytes))
    words = sum(by[..., i] << (8 * i) for i in range(nbytes))
    mask = (1 << bits) - 1
    return torch.cat([(words >> (bits * k)) & mask for k in range(planes)], dim=-1).to(torch.uint8)


def unpack_planar(packed: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """:func:`unpack_words` with byte-wide operations only (no int64 words): byte ``i`` of word ``e`` holds
    the codes of planes ``i * 8 / bits ...`` at ``bits``-bit steps."""
    per_byte = 8 // bits
    by = packed.unflatten(-1, (-1, planes // per_byte))  # [..., words, bytes of a word]
    mask = (1 << bits) - 1
    parts = [by & mask] + [(by >> (bits * k)) & mask for k in range(1, per_byte - 1)] + [by >> (8 - bits)]
    runs = torch.stack(parts, dim=-1).flatten(-2)  # [..., words, planes]: plane p = byte * per_byte + k
    return runs.transpose(-1, -2).flatten(-2)  # channel p * words + e


def packed_bytes(bits: tuple[int, ...]) -> int:
    """Bytes of one token's codes."""
    return -(-sum(bits) // 8)


def _stream(bits: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each bit of the packed stream: the channel it belongs to and its place in that channel's code."""
    ch = [i for i, b in enumerate(bits) for _ in range(b)]
    sh = [k for b in bits for k in range(b)]
    return torch.tensor(ch, dtype=torch.long, device=device), torch.tensor(sh, dtype=torch.long, device=device)


def pack_mixed(codes: torch.Tensor, bits: tuple[int, ...]) -> torch.Tensor:
    """``codes [..., d]`` into ``[..., packed_bytes(bits)]`` uint8: one bit stream per token."""
    ch, sh = _stream(bits, codes.device)
    stream = (codes.long()[..., ch] >> sh) & 1  # [..., total bits]
    n = packed_bytes(bits)
    stream = torch.nn.functional.pad(stream, (0, 8 * n - stream.shape[-1]))
    place = torch.arange(8, device=codes.device)
    return (stream.reshape(*codes.shape[:-1], n, 8) << place).sum(-1).to(torch.uint8)


def unpack_mixed(packed: torch.Tensor, bits: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_mixed`: ``[..., len(bits)]`` uint8 codes."""
    if packed.shape[-1] != packed_bytes(bits):
        raise ValueError(f"packed last dim {packed.shape[-1]} does not hold codes of widths summing to {sum(bits)}")
    ch, sh = _stream(bits, packed.device)
    k = torch.arange(ch.numel(), device=packed.device)
    bit = (packed.long()[..., k // 8] >> (k % 8)) & 1
    out = torch.zeros(*packed.shape[:-1], len(bits), dtype=torch.long, device=packed.device)
    out.index_add_(-1, ch, bit << sh)
    return out.to(torch.uint8)
