"""The decode kernel v3's fragment-ordered pack layout (issue 19): it round-trips, both products' register
operands come out of it with the kernel's bit operations, and the folded products of those operands equal the
dequantised products in float64."""

from __future__ import annotations

import pytest
import torch
from kernel_v3.folded import dequantised, folded_minimum, magic_number
from kernel_v3.fragment import (
    TILE,
    byte_perm,
    dequantise_registers,
    fragment_coords,
    movmatrix_trans,
    operand_tiles,
    output_operand,
    pack_fragments,
    scores_operand,
    transposed_operand,
    unpack_fragments,
)


def _codes(bits: int, tokens: int = 48, dim: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**bits, (tokens, dim), generator=torch.Generator().manual_seed(seed))


def _int4_groups(tokens: int, seed: int, dim: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT4 codes ``[T, D]`` with fp16 scales and minima per group of 64 channels ``[T, D / 64]``."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (tokens, dim), generator=gen)
    scale = (torch.rand(tokens, dim // 64, generator=gen) * 0.2 + 2.0**-10).half()
    minimum = (torch.randn(tokens, dim // 64, generator=gen) * 2).half()
    return codes, scale, minimum


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` as ``[T / 16, D / 16, 16, 16]`` tiles (tokens on the rows)."""
    t, d = x.shape
    return x.reshape(t // TILE, TILE, d // TILE, TILE).permute(0, 2, 1, 3)


def test_fragment_coords_are_ptx_m16n8k16_a_operand():
    rows, cols = fragment_coords()
    # PTX ISA: a0,a1 -> (groupID, 2 tid + i), a2,a3 -> (groupID + 8, ...), a4,a5 -> (groupID, 2 tid + 8 + i),
    # a6,a7 -> (groupID + 8, 2 tid + 8 + i); register r holds halves a_{2r}, a_{2r+1}
    for lane in (0, 5, 31):
        g, t = lane // 4, lane % 4
        want = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1), (g, 2 * t + 8), (g, 2 * t + 9),
                (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]  # fmt: skip
        assert list(zip(rows[lane].flatten().tolist(), cols[lane].flatten().tolist(), strict=True)) == want
    cover = torch.zeros(TILE, TILE, dtype=torch.long)
    cover.index_put_((rows.flatten(), cols.flatten()), torch.ones(256, dtype=torch.long), accumulate=True)
    assert bool((cover == 1).all())  # every element once


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_round_trips_and_keeps_the_bytes_per_token(bits):
    codes = _codes(bits)
    words = pack_fragments(codes, bits)
    assert words.shape == (48 // TILE, 128 // (TILE * 4 // bits), 32)
    assert int(words.min()) >= 0 and int(words.max()) < 2**32
    assert words.numel() * 4 == codes.numel() * bits // 8  # the plain layout's bytes
    assert torch.equal(unpack_fragments(words, bits), codes)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_both_operands_come_out_of_the_words(bits, dtype):
    codes = _codes(bits, seed=1)
    words = pack_fragments(codes, bits)
    want = _tiles(codes.double() + magic_number(dtype))
    assert torch.equal(operand_tiles(scores_operand(words, bits, dtype), dtype), want)
    assert torch.equal(operand_tiles(output_operand(words, bits, dtype), dtype), want.transpose(-1, -2))


def test_one_shift_operands_carry_16u_on_tokens_8_to_15():
    # operand4_x16 (the pipelined Hopper prototype): the high code of each byte read in place is 16 u, in both
    # products on tokens 8-15 of each tile, which the kernel's scales then divide by 16
    codes = _codes(4, seed=3)
    words = pack_fragments(codes, 4)
    weight = torch.ones(TILE, dtype=torch.float64)
    weight[8:] = 16
    want = _tiles(codes.double()) * weight[:, None] + 1024  # tokens on the rows
    assert torch.equal(operand_tiles(scores_operand(words, 4, x16=True)), want)
    assert torch.equal(operand_tiles(output_operand(words, 4, x16=True)), want.transpose(-1, -2))
    assert not torch.equal(operand_tiles(scores_operand(words, 4)), want)
    with pytest.raises(ValueError, match="INT4 codes and fp16"):
        scores_operand(words, 4, torch.bfloat16, x16=True)


def test_register_dequantisation_reads_the_right_scales():
    # stream_h16_dq_kernel's arithmetic and indexing, lane by lane: the one-shift registers dequantised with the
    # scale and minimum pairs read from the group-major copy (scale / 16 on tokens 8-15) give fp16(u s + m) of
    # every element, in both operands; a wrong lookup (or the 1/16 on the wrong tokens) changes elements
    codes, scale, minimum = _int4_groups(tokens=64, seed=4)
    want = codes.double() * scale.double().repeat_interleave(64, 1) + minimum.double().repeat_interleave(64, 1)
    want = _tiles(want.half().double())
    words = pack_fragments(codes, 4)
    for output in (False, True):
        make = output_operand if output else scores_operand
        got = operand_tiles(dequantise_registers(make(words, 4, x16=True), scale, minimum, output))
        assert torch.equal(got, want.transpose(-1, -2) if output else want)
    shuffled = scale.flip(0)  # the same values at the wrong tokens
    got = operand_tiles(dequantise_registers(scores_operand(words, 4, x16=True), shuffled, minimum, False))
    assert not torch.equal(got, want)


def test_movmatrix_transposes_an_8x8_matrix():
    # lane (g, t) holds row g, columns 2t (low half) and 2t + 1 (high half); after movmatrix.trans, of M^T
    m = torch.arange(64).reshape(8, 8) + 0x100
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    regs = m[g, 2 * t] | (m[g, 2 * t + 1] << 16)
    out = movmatrix_trans(regs)
    assert torch.equal(out & 0xFFFF, m.T[g, 2 * t]) and torch.equal(out >> 16, m.T[g, 2 * t + 1])


def test_transposed_in_registers_is_the_output_operand():
    # stream_h16_cs_kernel dequantises the scores operand once and transposes it in registers for the output:
    # four movmatrix of registers 0, 2, 1, 3 give, bit for bit, the dequantised output operand that variant 2
    # builds from the packed words a second time (so the same fp16 values as fp16(u s + m) transposed); in the
    # registers' own order (0, 1, 2, 3) the blocks of rows 8-15 and columns 0-7 would be swapped
    codes, scale, minimum = _int4_groups(tokens=32, seed=9)
    words = pack_fragments(codes, 4)
    scores_regs = dequantise_registers(scores_operand(words, 4, x16=True), scale, minimum, False)
    want = dequantise_registers(output_operand(words, 4, x16=True), scale, minimum, True)
    got = transposed_operand(scores_regs)
    assert torch.equal(got, want)
    assert torch.equal(operand_tiles(got), operand_tiles(scores_regs).transpose(-1, -2))
    in_order = torch.stack([movmatrix_trans(scores_regs[..., r]) for r in range(4)], -1)
    assert not torch.equal(in_order, want)


def test_output_operand_needs_the_half_select():
    # the byte permute takes half g % 2 of each word: with one selector for every lane the transpose is wrong
    codes = _codes(4, seed=2)
    words = pack_fragments(codes, 4)
    assert byte_perm(torch.tensor(0x33221100), torch.tensor(0x77665544), torch.tensor(0x7632)).item() == 0x77663322
    assert byte_perm(torch.tensor(0x33221100), torch.tensor(0x77665544), torch.tensor(0x5410)).item() == 0x55441100
    import kernel_v3.fragment as frag

    real = frag.byte_perm
    try:
        frag.byte_perm = lambda a, b, s: real(a, b, torch.full_like(s, 0x5410))
        wrong = operand_tiles(output_operand(words, 4))
    finally:
        frag.byte_perm = real
    assert not torch.equal(wrong, _tiles(codes.double() + 1024).transpose(-1, -2))


def test_pack_refuses_what_it_cannot_hold():
    for codes, bits, msg in ((_codes(4)[:40], 4, "multiple of 16"), (_codes(2)[:, :112], 2, "of 32"),
                             (_codes(4) + 16, 4, r"\[0, 16\)"), (_codes(4), 3, "2 or 4")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            pack_fragments(codes, bits)


@pytest.mark.parametrize("bits,group", [(4, 64), (2, 64), (4, 32)])
def test_folded_products_of_the_fragment_operands_equal_the_dequantised_ones(bits, group):
    # the v3 inner loop emulated from the register operands: scores tile by tile with one accumulator per
    # group, scaled after; output with s o P as the other operand and the rank-1 terms (float64 throughout)
    gen = torch.Generator().manual_seed(3)
    tokens, dim, heads = 64, 128, 16
    codes = _codes(bits, tokens, dim, seed=4)
    scale = torch.rand(tokens, dim // group, generator=gen, dtype=torch.float64) * 0.2 + 1e-3
    minimum = torch.randn(tokens, dim // group, generator=gen, dtype=torch.float64)
    q = torch.randn(heads, dim, generator=gen, dtype=torch.float64)
    p = torch.softmax(torch.randn(heads, tokens, generator=gen, dtype=torch.float64), -1)
    words = pack_fragments(codes, bits)
    a_s = operand_tiles(scores_operand(words, bits))  # [T/16, D/16, 16 tokens, 16 channels]
    a_o = operand_tiles(output_operand(words, bits))  # [T/16, D/16, 16 channels, 16 tokens]
    per = group // TILE  # channel tiles per group
    x = dequantised(codes, scale, minimum, group)
    mf = folded_minimum(scale, minimum, torch.float64)
    qt = q.reshape(heads, dim // TILE, TILE)
    scores = torch.zeros(tokens, heads, dtype=torch.float64)
    out = torch.zeros(heads, dim, dtype=torch.float64)
    for tb in range(tokens // TILE):
        rows = slice(tb * TILE, (tb + 1) * TILE)
        for g in range(dim // group):
            acc = sum(a_s[tb, c] @ qt[:, c].T for c in range(g * per, (g + 1) * per))  # [16 tokens, heads]
            qsum = q[:, g * group : (g + 1) * group].sum(-1)
            scores[rows] += scale[rows, g, None] * acc + mf[rows, g, None] * qsum[None]
            w = scale[rows, g][:, None] * p[:, rows].T  # (s o P)^T [16 tokens, heads]
            for c in range(g * per, (g + 1) * per):
                out[:, c * TILE : (c + 1) * TILE] += (a_o[tb, c] @ w).T
            out[:, g * group : (g + 1) * group] += (p[:, rows] @ minimum[rows, g] - 1024 * w.sum(0))[:, None]
    assert torch.allclose(scores, x @ q.T, rtol=0, atol=1e-10 * (x @ q.T).abs().max().item())
    assert torch.allclose(out, p @ x, rtol=0, atol=1e-10 * (p @ x).abs().max().item())
