"""Low-bit MLA decode with the group scale folded out of the tile (DeepSeek geometry: d_c = 8 groups of 64).

Integer codes (0..15) are exact in BF16, so the tile fed to the tensor cores is the codes
themselves, converted once; no per-element multiply-add. With ``c = code * s_g + m_g`` per group g:

    q . c  = sum_g s_g (q_g . code_g) + m_g sum(q_g)             (scores: scale on the [H, T] result)
    P @ c  = sum_g (P * s_g) @ code_g  (+)  (P @ m_g) 1^T          (values: scale folded into P,
                                                                    minimum as a rank-1 term)

The per-group minimum terms of both products are small matrix products against the ``[T, 8]``
minima (padded to 16 columns). Partial outputs use the layout of :mod:`quantmla.kernels.decode`, so
its window and combine kernels finish the job.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels.decode import _split_pages

__all__ = ["fold_supported", "launch_fold"]


@triton.jit
def _codes(CC, tok, tmask, g: tl.constexpr, CBITS: tl.constexpr, DC: tl.constexpr, DT: tl.constexpr):
    """Codes of group ``g`` (channels 64g .. 64g+63) as ``[BLOCK_T, 64]`` in DT (exact)."""
    cols = tl.arange(0, 64)[None, :]
    if CBITS == 4:  # byte j: channel j (low nibble), j + DC/2 (high nibble)
        byt = tl.load(CC + tok[:, None] * (DC // 2) + (g % 4) * 64 + cols, mask=tmask[:, None], other=0)
        x = (byt >> (4 * (g // 4))) & 15
    else:  # 2 bits: byte j holds channels j, j + DC/4, j + DC/2, j + 3DC/4
        byt = tl.load(CC + tok[:, None] * (DC // 4) + (g % 2) * 64 + cols, mask=tmask[:, None], other=0)
        x = (byt >> (2 * (g // 2))) & 3
    return x.to(DT)


@triton.jit
def _score_group(qk, q, CC, CS, tok, tmask, g: tl.constexpr, CBITS: tl.constexpr, DC: tl.constexpr, DT: tl.constexpr):
    s = tl.load(CS + tok * 8 + g, mask=tmask, other=0.0).to(tl.float32)
    return qk + tl.dot(q, tl.trans(_codes(CC, tok, tmask, g, CBITS, DC, DT))) * s[None, :]


@triton.jit
def _value_group(
    acc, p, alpha, CC, CS, tok, tmask, g: tl.constexpr, CBITS: tl.constexpr, DC: tl.constexpr, DT: tl.constexpr
):
    s = tl.load(CS + tok * 8 + g, mask=tmask, other=0.0).to(tl.float32)
    return acc * alpha[:, None] + tl.dot((p * s[None, :]).to(DT), _codes(CC, tok, tmask, g, CBITS, DC, DT))


@triton.jit
def _paged_fold_kernel(
    Q, QR, CC, CS, CM, RC, RS, RM, BT, NPAGED, KSTART, OP, LP,
    H, MAXP, NS, NSP, scale_log2,
    DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    CBITS: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    hg = tl.program_id(2)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    hm = hmask[:, None]
    qb = Q + (b * H + heads)[:, None] * DC + tl.arange(0, 64)[None, :]
    q0 = tl.load(qb, mask=hm, other=0.0)
    q1 = tl.load(qb + 64, mask=hm, other=0.0)
    q2 = tl.load(qb + 128, mask=hm, other=0.0)
    q3 = tl.load(qb + 192, mask=hm, other=0.0)
    q4 = tl.load(qb + 256, mask=hm, other=0.0)
    q5 = tl.load(qb + 320, mask=hm, other=0.0)
    q6 = tl.load(qb + 384, mask=hm, other=0.0)
    q7 = tl.load(qb + 448, mask=hm, other=0.0)
    # per-group sums of q, as [BLOCK_H, 16] (8 used) for the minimum terms
    c16 = tl.arange(0, 16)[None, :]
    qsum = tl.where(c16 == 0, tl.sum(q0.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 1, tl.sum(q1.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 2, tl.sum(q2.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 3, tl.sum(q3.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 4, tl.sum(q4.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 5, tl.sum(q5.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 6, tl.sum(q6.to(tl.float32), 1)[:, None], 0.0)
    qsum += tl.where(c16 == 7, tl.sum(q7.to(tl.float32), 1)[:, None], 0.0)
    RPL: tl.constexpr = DR // 2
    qrb = QR + (b * H + heads)[:, None] * DR + tl.arange(0, RPL)[None, :]
    qr0 = tl.load(qrb, mask=hm, other=0.0)
    qr1 = tl.load(qrb + RPL, mask=hm, other=0.0)
    qrsum = tl.sum(qr0.to(tl.float32), 1) + tl.sum(qr1.to(tl.float32), 1)
    q0, q1, q2, q3 = q0.to(DT), q1.to(DT), q2.to(DT), q3.to(DT)
    q4, q5, q6, q7 = q4.to(DT), q5.to(DT), q6.to(DT), q7.to(DT)
    qr0, qr1 = qr0.to(DT), qr1.to(DT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    a0 = tl.zeros([BLOCK_H, 64], tl.float32)
    a1 = tl.zeros([BLOCK_H, 64], tl.float32)
    a2 = tl.zeros([BLOCK_H, 64], tl.float32)
    a3 = tl.zeros([BLOCK_H, 64], tl.float32)
    a4 = tl.zeros([BLOCK_H, 64], tl.float32)
    a5 = tl.zeros([BLOCK_H, 64], tl.float32)
    a6 = tl.zeros([BLOCK_H, 64], tl.float32)
    a7 = tl.zeros([BLOCK_H, 64], tl.float32)
    macc = tl.zeros([BLOCK_H, 16], tl.float32)

    n, kstart, p0, p1 = _split_pages(NPAGED, KSTART, b, split, NS, PAGE)
    for p in range(p0, p1):
        page = tl.load(BT + b * MAXP + p).to(tl.int64)
        for t0 in tl.static_range(0, PAGE, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            tmask = (p * PAGE + rows < n) & (p * PAGE + rows >= kstart)
            tok = page * PAGE + rows
            mins = tl.load(CM + tok[:, None] * 8 + c16, mask=tmask[:, None] & (c16 < 8), other=0.0).to(tl.float32)
            qk = tl.dot(qsum, tl.trans(mins), input_precision="ieee")  # sum_g m_g sum(q_g), fp32
            qk = _score_group(qk, q0, CC, CS, tok, tmask, 0, CBITS, DC, DT)
            qk = _score_group(qk, q1, CC, CS, tok, tmask, 1, CBITS, DC, DT)
            qk = _score_group(qk, q2, CC, CS, tok, tmask, 2, CBITS, DC, DT)
            qk = _score_group(qk, q3, CC, CS, tok, tmask, 3, CBITS, DC, DT)
            qk = _score_group(qk, q4, CC, CS, tok, tmask, 4, CBITS, DC, DT)
            qk = _score_group(qk, q5, CC, CS, tok, tmask, 5, CBITS, DC, DT)
            qk = _score_group(qk, q6, CC, CS, tok, tmask, 6, CBITS, DC, DT)
            qk = _score_group(qk, q7, CC, CS, tok, tmask, 7, CBITS, DC, DT)
            rbyt = tl.load(RC + tok[:, None] * RPL + tl.arange(0, RPL)[None, :], mask=tmask[:, None], other=0)
            rs = tl.load(RS + tok, mask=tmask, other=0.0).to(tl.float32)
            rm = tl.load(RM + tok, mask=tmask, other=0.0).to(tl.float32)
            qkr = tl.dot(qr0, tl.trans((rbyt & 15).to(DT))) + tl.dot(qr1, tl.trans((rbyt >> 4).to(DT)))
            qk += qkr * rs[None, :] + qrsum[:, None] * rm[None, :]
            qk = tl.where(tmask[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            macc = macc * alpha[:, None] + tl.dot(pr, mins, input_precision="ieee")
            a0 = _value_group(a0, pr, alpha, CC, CS, tok, tmask, 0, CBITS, DC, DT)
            a1 = _value_group(a1, pr, alpha, CC, CS, tok, tmask, 1, CBITS, DC, DT)
            a2 = _value_group(a2, pr, alpha, CC, CS, tok, tmask, 2, CBITS, DC, DT)
            a3 = _value_group(a3, pr, alpha, CC, CS, tok, tmask, 3, CBITS, DC, DT)
            a4 = _value_group(a4, pr, alpha, CC, CS, tok, tmask, 4, CBITS, DC, DT)
            a5 = _value_group(a5, pr, alpha, CC, CS, tok, tmask, 5, CBITS, DC, DT)
            a6 = _value_group(a6, pr, alpha, CC, CS, tok, tmask, 6, CBITS, DC, DT)
            a7 = _value_group(a7, pr, alpha, CC, CS, tok, tmask, 7, CBITS, DC, DT)
            m_i = m_new

    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LP + (b * NSP + split) * H + heads, lse, mask=hmask)
    ob = OP + ((b * NSP + split) * H + heads)[:, None] * DC + tl.arange(0, 64)[None, :]
    tl.store(ob, (a0 + tl.sum(tl.where(c16 == 0, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 64, (a1 + tl.sum(tl.where(c16 == 1, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 128, (a2 + tl.sum(tl.where(c16 == 2, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 192, (a3 + tl.sum(tl.where(c16 == 3, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 256, (a4 + tl.sum(tl.where(c16 == 4, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 320, (a5 + tl.sum(tl.where(c16 == 5, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 384, (a6 + tl.sum(tl.where(c16 == 6, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)
    tl.store(ob + 448, (a7 + tl.sum(tl.where(c16 == 7, macc, 0.0), 1)[:, None]) * inv[:, None], mask=hm)


def fold_supported(kv_lora_rank: int, rope_dim: int, group_size: int, content_bits: int, rope_bits: int) -> bool:
    return (kv_lora_rank, rope_dim, group_size, rope_bits) == (512, 64, 64, 4) and content_bits in (4, 2)


def launch_fold(grid, *args, **kw):
    return _paged_fold_kernel[grid](*args, **kw)
