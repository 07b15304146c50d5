"""The fragment-ordered pack layout of the decode kernel v3 (issue 19): codes stored in the order the tensor
cores' register operand wants them, so both products of a tile unpack straight into registers.

The MMA's register operand ``A`` (``mma.m16n8k16`` and each warp's 16 rows of ``wgmma.m64nNk16`` with ``A`` in
registers, fp16 or bf16) gives lane ``l`` (``g = l // 4``, ``t = l % 4``) four 32-bit registers ``r`` of two
halves ``e``: element ``(row, col) = (g + 8 (r & 1), 2 t + 8 (r >> 1) + e)`` of a 16 x 16 tile (PTX ISA,
"Matrix fragments for mma.m16n8k16").

**Storage.** The codes of 16 tokens x 16 channels (a *tile*) are 32 words in lane order: lane ``l``'s word holds
the eight codes its scores operand needs (tokens on the rows), code ``(r, e)`` of tile ``j`` at bit
``16 e + bits (4 j + r)``; at 4 bits one tile fills a word, at 2 bits a word holds two tiles that follow along
the channels (``j`` = 0, 1). The bytes per token are those of the plain layout (``d * bits / 8``).

**Scores operand** (``S^T = C Q^T``, tokens on M): register ``r`` of tile ``j`` is
``((w >> bits (4 j + r)) & 0x000F000F) | 0x64006400`` (mask ``0x00030003`` at 2 bits): two fp16 values
``1024 + code``, the magic conversion, one shift and one ``lop3``.

**Output operand** (``O^T = C^T (s o P)^T``, channels on M): the same tile transposed. Lane ``(g, t)`` needs the
codes of tokens ``2t, 2t+1, 2t+8, 2t+9`` for channels ``g, g+8``: they are in the words of lanes ``(2t, g // 2)``
(tokens ``2t``, ``2t+8``) and ``(2t+1, g // 2)`` (``2t+1``, ``2t+9``), in the half ``g % 2``. One byte permute
takes that half of each, ``c = prmt(a, b, g % 2 ? 0x7632 : 0x5410)``, and the registers follow as for the
scores with register ``r`` read at position ``(0, 2, 1, 3)[r]``: two shared-memory words and one ``prmt`` more
per tile than the scores operand, and no dequantised tile anywhere.

These functions do exactly those bit operations on int64 tensors holding 32-bit patterns, so the CPU tests check
the layout and the instruction sequence the kernel will run (``tests/kernels/test_fragment.py``).
"""

from __future__ import annotations

import torch

TILE = 16
LANES = 32
MASK32 = 0xFFFFFFFF
#: the magic conversion's pattern per operand type, in both halves of a register
MAGIC_PAIRS = {torch.float16: 0x64006400, torch.bfloat16: 0x43004300}
#: the scores register ``r`` that the output operand's register ``r`` reads (rows and columns swap roles)
OUTPUT_POSITIONS = (0, 2, 1, 3)


def fragment_coords() -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)``, each ``[32, 4, 2]``: the tile element of lane, register and half of the A operand."""
    lane = torch.arange(LANES)[:, None, None]
    r = torch.arange(4)[None, :, None]
    e = torch.arange(2)[None, None, :]
    g, t = lane // 4, lane % 4
    return (g + 8 * (r & 1)).expand(LANES, 4, 2), (2 * t + 8 * (r >> 1) + e).expand(LANES, 4, 2)


def _check(codes: torch.Tensor, bits: int) -> None:
    if bits not in (2, 4):
        raise ValueError(f"bits={bits}; the fragment layout packs 2 or 4")
    if codes.dim() != 2 or codes.shape[0] % TILE or codes.shape[1] % (TILE * 4 // bits):
        raise ValueError(
            f"codes {tuple(codes.shape)} must be [tokens, channels] with tokens a multiple of {TILE} and channels "
            f"of {TILE * 4 // bits} at {bits} bits"
        )
    if codes.dtype.is_floating_point or int(codes.min()) < 0 or int(codes.max()) >= 2**bits:
        raise ValueError(f"codes must be integers in [0, {2**bits})")


def pack_fragments(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[T / 16, D / (16 k), 32]`` words (``k = 4 / bits`` tiles each; int64 holding uint32) of ``codes [T, D]``."""
    _check(codes, bits)
    t, d = codes.shape
    k = 4 // bits
    rows, cols = fragment_coords()
    # [T/16, D/(16k), k, 16, 16] tiles, then each lane's codes at (tile j, register r, half e)
    tiles = codes.long().reshape(t // TILE, TILE, d // (TILE * k), k, TILE).permute(0, 2, 3, 1, 4)
    per_lane = tiles[:, :, :, rows, cols]  # [T/16, D/(16k), k, 32, 4, 2]
    j = torch.arange(k)[:, None, None, None]
    r = torch.arange(4)[None, None, :, None]
    e = torch.arange(2)[None, None, None, :]
    shift = 16 * e + bits * (4 * j + r)  # [k, 1, 4, 2]
    return (per_lane << shift).sum((2, 4, 5))  # disjoint bit fields: the sum is the OR


def unpack_fragments(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes ``[T, D]`` back from :func:`pack_fragments`' words."""
    nt, nw, _ = words.shape
    k = 4 // bits
    j = torch.arange(k)[:, None, None, None]
    r = torch.arange(4)[None, None, :, None]
    e = torch.arange(2)[None, None, None, :]
    shift = 16 * e + bits * (4 * j + r)
    per_lane = (words[:, :, None, :, None, None] >> shift) & (2**bits - 1)  # [nt, nw, k, 32, 4, 2]
    tiles = torch.zeros(nt, nw, k, TILE, TILE, dtype=torch.long)
    rows, cols = fragment_coords()
    tiles[:, :, :, rows, cols] = per_lane
    return tiles.permute(0, 3, 1, 2, 4).reshape(nt * TILE, nw * k * TILE)


def _registers(c: torch.Tensor, positions, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``[..., k, 4]`` registers: ``((c >> bits (4 j + p)) & mask) | magic`` for each tile ``j`` and position."""
    k = 4 // bits
    mask = (2**bits - 1) * 0x00010001
    shift = bits * (4 * torch.arange(k)[:, None] + torch.tensor(positions)[None, :])  # [k, 4]
    return ((c[..., None, None] >> shift) & mask) | MAGIC_PAIRS[dtype]


def _registers_x16(c: torch.Tensor, positions, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """INT4, fp16: position ``p`` read as ``((c >> 8 (p // 2)) & (0x000F000F << 4 (p % 2))) | magic``, one shift a
    word; the odd positions (a byte's high code) come out as ``1024 + 16 u`` (``operand4_x16`` in
    ``hopper/fragment.cuh``)."""
    if bits != 4 or dtype != torch.float16:
        raise ValueError(f"the one-shift operand needs INT4 codes and fp16 operands, got {bits} bits, {dtype}")
    p = torch.tensor(positions)
    shift, mask = 8 * (p // 2), 0x000F000F << (4 * (p % 2))
    return (((c[..., None] >> shift) & mask) | MAGIC_PAIRS[dtype])[..., None, :]  # [..., k = 1, 4]


def scores_operand(
    words: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16, x16: bool = False
) -> torch.Tensor:
    """``[T / 16, D / 16, 32, 4]`` register patterns of the scores product's A operand (tokens on the rows).
    With ``x16`` (INT4, fp16) the one-shift form: tokens 8-15 of each tile carry ``16 u``."""
    regs = (_registers_x16 if x16 else _registers)(words, (0, 1, 2, 3), bits, dtype)  # [nt, nw, 32, k, 4]
    return regs.permute(0, 1, 3, 2, 4).reshape(words.shape[0], -1, LANES, 4)


def byte_perm(a: torch.Tensor, b: torch.Tensor, selector: torch.Tensor) -> torch.Tensor:
    """CUDA's ``__byte_perm(a, b, s)`` (PTX ``prmt.b32``, default mode): byte ``i`` of the result is byte
    ``(s >> 4 i) & 7`` of the 8 bytes ``b:a``."""
    both = (a & MASK32) | ((b & MASK32) << 32)
    out = torch.zeros_like(a)
    for i in range(4):
        src = (selector >> (4 * i)) & 7
        out |= ((both >> (8 * src)) & 0xFF) << (8 * i)
    return out


def output_operand(
    words: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16, x16: bool = False
) -> torch.Tensor:
    """``[T / 16, D / 16, 32, 4]`` register patterns of the output product's A operand: each tile transposed
    (channels on the rows), from two words of the tile and one byte permute per lane. With ``x16`` (INT4, fp16)
    the one-shift form: tokens 8-15 (the columns) carry ``16 u``."""
    lane = torch.arange(LANES)
    g, t = lane // 4, lane % 4
    a = words[..., 4 * (2 * t) + g // 2]  # tokens 2t and 2t+8
    b = words[..., 4 * (2 * t + 1) + g // 2]  # tokens 2t+1 and 2t+9
    c = byte_perm(a, b, torch.where(g % 2 == 1, 0x7632, 0x5410))
    regs = (_registers_x16 if x16 else _registers)(c, OUTPUT_POSITIONS, bits, dtype)  # [nt, nw, 32, k, 4]
    return regs.permute(0, 1, 3, 2, 4).reshape(words.shape[0], -1, LANES, 4)


def operand_tiles(regs: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``[T / 16, D / 16, 16, 16]`` tiles (float64) that the register patterns ``[.., 32, 4]`` stand for."""
    halves = torch.stack([regs & 0xFFFF, (regs >> 16) & 0xFFFF], -1)  # [..., 32, 4, 2]
    signed = torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16)
    values = signed.view(dtype).double()
    tiles = torch.zeros(*regs.shape[:-2], TILE, TILE, dtype=torch.float64)
    rows, cols = fragment_coords()
    tiles[..., rows, cols] = values
    return tiles


#: the transposed tile's register ``r`` is the transpose of the tile's register ``TRANSPOSED_FROM[r]`` (its 8 x 8
#: blocks: rows 0-7 / 8-15 and columns 0-7 / 8-15 swap roles)
TRANSPOSED_FROM = (0, 2, 1, 3)


def movmatrix_trans(regs: torch.Tensor) -> torch.Tensor:
    """PTX ``movmatrix.sync.aligned.m8n8.trans.b16`` on ``[..., 32]`` registers: lane ``(g, t)`` holds row ``g``,
    columns ``2t, 2t + 1`` of an 8 x 8 b16 matrix (the low half first), afterwards those of its transpose:
    elements ``(2t, g)`` and ``(2t + 1, g)``, half ``g % 2`` of lanes ``4 (2t) + g // 2`` and
    ``4 (2t + 1) + g // 2``."""
    lane = torch.arange(LANES)
    g, t = lane // 4, lane % 4
    half = 16 * (g % 2)
    lo = (regs[..., 4 * (2 * t) + g // 2] >> half) & 0xFFFF
    hi = (regs[..., 4 * (2 * t + 1) + g // 2] >> half) & 0xFFFF
    return lo | (hi << 16)


def transposed_operand(regs: torch.Tensor) -> torch.Tensor:
    """The A operand of each tile's transpose ``[..., 32, 4]`` made in registers from the tile's own (four
    ``movmatrix``, ``stream_h16_cs.cu``): register ``r`` from register :data:`TRANSPOSED_FROM` ``[r]``."""
    return torch.stack([movmatrix_trans(regs[..., TRANSPOSED_FROM[r]]) for r in range(4)], -1)


def group_major(x: torch.Tensor) -> torch.Tensor:
    """Per-token scales or minima ``[T, G]`` as ``[T / 16, G, 16]``: group-major within each 16-token tile (the
    layout the register-dequantising Hopper prototype reads token pairs from)."""
    return x.view(-1, TILE, x.shape[-1]).transpose(1, 2).contiguous()


def dequantise_registers(regs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, output: bool) -> torch.Tensor:
    """What ``stream_h16_dq_kernel`` makes of the one-shift INT4 registers ``regs [T / 16, D / 16, 32, 4]``
    (:func:`scores_operand` / :func:`output_operand` with ``x16``): each half ``x = fp16((U - 1024) s + m)`` with
    one rounding (``HSUB2`` exact, then ``HFMA2``), the scale divided by 16 where the code is ``16 u``, the scales
    and minima ``[T, D / 64]`` looked up as the kernel does in their :func:`group_major` copy. Returns the fp16
    register patterns, int64."""
    nt, tiles = regs.shape[:2]
    groups = scale.shape[-1]
    sg, mg = group_major(scale).reshape(-1).double(), group_major(minimum).reshape(-1).double()
    kt = torch.arange(nt)[:, None, None, None, None]
    tile = torch.arange(tiles)[None, :, None, None, None]
    lane = torch.arange(LANES)[None, None, :, None, None]
    r = torch.arange(4)[None, None, None, :, None]
    e = torch.arange(2)[None, None, None, None, :]
    g = tile // (tiles // groups)  # the group of the tile's channels
    if output:  # rows channels, columns tokens 2t + 8 (r >> 1) + e of the tile: pair loads
        x16 = (r >> 1) == 1
        idx = (kt * groups + g) * TILE + 2 * (lane % 4) + 8 * (r >> 1) + e
    else:  # rows tokens lane / 4 + 8 (r & 1), both halves one token: broadcast loads
        x16 = (r & 1) == 1
        idx = (kt * groups + g) * TILE + lane // 4 + 8 * (r & 1) + 0 * e
    s = torch.where(x16, sg[idx] / 16, sg[idx])
    halves = torch.stack([regs & 0xFFFF, (regs >> 16) & 0xFFFF], -1)  # [..., 4, 2]
    code = torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16).view(torch.float16).double() - 1024
    x = (code * s + mg[idx]).half()  # exact in float64, then the one rounding
    bits = x.view(torch.int16).to(torch.int64) & 0xFFFF
    return bits[..., 0] | (bits[..., 1] << 16)
