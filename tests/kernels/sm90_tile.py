"""The sm_90a decode kernel's shared-memory arithmetic in Python, step for step as
``src/quantmla/kernels/hopper/csrc/decode_sm90.cu`` does it,
so that the CPU tests can check it: where the producer stores each dequantised value of a K tile, what the
wgmma operand descriptors read back (the 128-byte-swizzle canonical layouts, K-major for the scores and
N-major for the output), and the unpack of group-planar code words into fp16 pairs (lop3 + sub + fma).
"""

from __future__ import annotations

import numpy as np

TILE = 64  # tokens a K tile
BLOCK_BYTES = TILE * 128  # one 64-channel block of a tile
PLANE_WIDTH = 64  # content channels a plane (= a block); RoPE planes are 16 wide
SBO = 1024  # bytes between 8-row groups (one swizzle atom)


def swizzle(addr: int) -> int:
    """The 128-byte swizzle on a shared-memory byte address: its 16-byte chunk (bits 4-6) XOR its row in the
    1024-byte atom (bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def sw128_offset(row: int, chunk: int) -> int:
    """``sw128_offset`` of the kernel: byte offset of (row, 16-byte chunk) in a tile of 128-byte rows."""
    return row * 128 + ((chunk ^ (row & 7)) << 4)


def tile_offset(token: int, channel: int) -> int:
    """Where the producer stores ``channel`` (0-575) of ``token`` inside a K tile (bytes)."""
    block, c = divmod(channel, 64)
    return block * BLOCK_BYTES + sw128_offset(token, c // 8) + (c % 8) * 2


def k_major_read(start: int, row: int, k: int) -> int:
    """The address a K-major, 128-byte-swizzled wgmma operand (descriptor ``start``, ``SBO``) reads for
    element (row, k): CUTLASS's canonical ``((8, m), (T, 2k)) : ((8T, SBO), (1, T))``, then the swizzle."""
    return swizzle(start + (row // 8) * SBO + (row % 8) * 128 + 2 * k)


def n_major_read(start: int, lbo: int, n: int, k: int) -> int:
    """The address an N-major (transposed), 128-byte-swizzled operand reads for element (n, k): canonical
    ``((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))`` (T = 8 fp16), then the swizzle."""
    return swizzle(start + (n % 64) * 2 + (n // 64) * lbo + (k % 8) * 128 + (k // 8) * SBO)


def scores_operand(kbase: int, kb: int, ks: int) -> int:
    """Descriptor start of the B operand of score step (block ``kb``, k step ``ks``)."""
    return kbase + kb * BLOCK_BYTES + ks * 32


def value_operand(kbase: int, wg: int, ks: int) -> tuple[int, int]:
    """Descriptor start and LBO of the B operand (V) of warpgroup ``wg``'s output step ``ks`` (16 tokens)."""
    return kbase + 4 * wg * BLOCK_BYTES + ks * 16 * 128, BLOCK_BYTES


def byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA ``__byte_perm``: byte ``i`` of the result is byte ``(sel >> 4 i) & 7`` of ``y:x``."""
    b = (x | (y << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(b[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def dequant_pair(x: int, sm: int, bits: int, pos: int) -> tuple[np.float16, np.float16]:
    """``dequant_pair<bits, pos>``: the codes at bit ``pos`` of each 16-bit half of ``x`` as ``code * s + m`` in
    fp16 (``sm``: fp16 scale low, minimum high), through the kernel's lop3 / sub / fma."""
    shift = 8 if pos + bits > 10 else 0
    bit = pos - shift
    v = x >> shift
    mask1 = ((1 << bits) - 1) << bit
    magic1 = (25 - bit) << 10
    t = (v & (mask1 | mask1 << 16)) | (magic1 | magic1 << 16)  # lop3 0xea
    halves = np.array([t & 0xFFFF, t >> 16], dtype=np.uint16).view(np.float16)
    magic = np.array([magic1], dtype=np.uint16).view(np.float16)[0]
    s, m = np.array([sm & 0xFFFF, sm >> 16], dtype=np.uint16).view(np.float16)
    codes = (halves - magic).astype(np.float16)  # exact
    out = (codes.astype(np.float64) * np.float64(s) + np.float64(m)).astype(np.float16)  # one rounding, as fma.rn
    return out[0], out[1]


def produce_token(smem: bytearray, kbase: int, token: int, cw: bytes, csm: bytes, rw: bytes, rsm: bytes, cbits: int):
    """The producer's two threads of ``token`` (halves 0 and 1): its field bytes (content words ``cw``, content
    scale words ``csm``, RoPE words ``rw``, RoPE scale word ``rsm``) into the K tile at ``kbase`` of ``smem``."""
    words32 = np.frombuffer(cw, dtype=np.uint32)
    sm = np.frombuffer(csm, dtype=np.uint32)

    def store(addr: int, pairs) -> None:
        smem[addr : addr + 16] = np.array([v for p in pairs for v in p], dtype=np.float16).tobytes()

    for half in (0, 1):
        for k in range(4):
            e8 = 4 * half + k
            off = sw128_offset(token, e8)
            if cbits == 4:
                wd = [int(w) for w in words32[8 * e8 : 8 * e8 + 8]]
                lo = [byte_perm(wd[2 * i], wd[2 * i + 1], 0x5410) for i in range(4)]
                hi = [byte_perm(wd[2 * i], wd[2 * i + 1], 0x7632) for i in range(4)]
                for plane in range(8):
                    src = lo if plane < 4 else hi
                    pairs = [dequant_pair(x, int(sm[plane]), 4, 4 * (plane % 4)) for x in src]
                    store(kbase + plane * BLOCK_BYTES + off, pairs)
            else:  # INT2: 16-bit words, a register holds two channels' words
                x = [int(w) for w in np.frombuffer(cw[16 * e8 : 16 * e8 + 16], dtype=np.uint32)]
                for plane in range(8):
                    store(kbase + plane * BLOCK_BYTES + off, [dequant_pair(v, int(sm[plane]), 2, 2 * plane) for v in x])
        rx = [int(w) for w in np.frombuffer(rw[16 * half : 16 * half + 16], dtype=np.uint32)]
        rs = int(np.frombuffer(rsm, dtype=np.uint32)[0])
        for plane in range(4):
            addr = kbase + 8 * BLOCK_BYTES + sw128_offset(token, 2 * plane + half)
            store(addr, [dequant_pair(v, rs, 4, 4 * plane) for v in rx])
