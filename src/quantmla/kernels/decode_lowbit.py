"""The fused low-bit MLA decode kernel: INT4/INT2 content and INT4 RoPE key, paged, split-KV.

Program ``(b, split, head_group)`` walks a contiguous range of sequence ``b``'s pages. Each 64-token
tile is loaded as group-planar code words (:func:`quantmla.formats.packing.pack_words`) and turned
into fp16 planes with :mod:`quantmla.kernels.unpack` (one plane = one run of channels inside one
quantisation group, so scale and minimum are per token), then both products run on the tensor cores
in fp16 with fp32 accumulation: ``s = q_lat c^T + q_pe k_R^T`` and ``o += softmax(s) c``, every head
of the group sharing the tile. The queries are cast to fp16 once per program (they must stay below
65504 in magnitude; the kernel's output is then exact up to fp16 rounding of q, c and p).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels.decode import (
    init_state,
    online_softmax,
    page_score_mask,
    query_offsets,
    query_rows,
    shadow_row_pointers,
    window_score_mask,
)
from quantmla.kernels.splits import plan_pages_per_split, split_pages
from quantmla.kernels.unpack import dequant4, dequant8


@triton.jit
def _scale(SM, tok, tmask, k: tl.constexpr, PW: tl.constexpr, G: tl.constexpr):
    """The scale|minimum words ``[T, 1]`` of plane ``k`` (``SM + tok``: each token's first int32
    scale|minimum word)."""
    return tl.load(SM + tok + (k * PW) // G, mask=tmask, other=0)[:, None]


@triton.jit
def _scales8(SM, tok, tmask, PW: tl.constexpr, G: tl.constexpr, T: tl.constexpr):
    """The scale|minimum words ``[T, 1]`` of the 8 content planes, from one ``[T, 8]`` load."""
    k = tl.arange(0, 8)[None, :]
    sm = tl.load(SM + tok[:, None] + (k * PW) // G, mask=tmask[:, None], other=0)
    x0, x1 = tl.split(tl.reshape(sm, [T, 4, 2]))  # planes 2i, 2i + 1
    x00, x01 = tl.split(tl.reshape(x0, [T, 2, 2]))  # planes 4i, 4i + 2
    x10, x11 = tl.split(tl.reshape(x1, [T, 2, 2]))  # planes 4i + 1, 4i + 3
    s0, s4 = tl.split(x00)
    s2, s6 = tl.split(x01)
    s1, s5 = tl.split(x10)
    s3, s7 = tl.split(x11)
    return (s0[:, None], s1[:, None], s2[:, None], s3[:, None], s4[:, None], s5[:, None], s6[:, None],
            s7[:, None])  # fmt: skip


@triton.jit
def _attend8(
    q0, q1, q2, q3, q4, q5, q6, q7, qr0, qr1, qr2, qr3, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3, smask,
    m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, scale_log2, DT: tl.constexpr, SAFE: tl.constexpr,
):  # fmt: skip
    """One tile of the online softmax over eight content planes and four RoPE planes (all ``DT``); ``smask``
    the score mask (``[1, T]``, or ``[rows, T]`` with ``SAFE``: see :func:`~quantmla.kernels.decode.online_softmax`)."""
    qk = tl.dot(q0, tl.trans(c0))
    qk += tl.dot(q1, tl.trans(c1))
    qk += tl.dot(q2, tl.trans(c2))
    qk += tl.dot(q3, tl.trans(c3))
    qk += tl.dot(q4, tl.trans(c4))
    qk += tl.dot(q5, tl.trans(c5))
    qk += tl.dot(q6, tl.trans(c6))
    qk += tl.dot(q7, tl.trans(c7))
    qk += tl.dot(qr0, tl.trans(r0))
    qk += tl.dot(qr1, tl.trans(r1))
    qk += tl.dot(qr2, tl.trans(r2))
    qk += tl.dot(qr3, tl.trans(r3))
    m_new, l_i, alpha, pr = online_softmax(qk, smask, m_i, l_i, scale_log2, SAFE)
    pb = pr.to(tl.float16).to(DT)
    a0 = a0 * alpha[:, None] + tl.dot(pb, c0)
    a1 = a1 * alpha[:, None] + tl.dot(pb, c1)
    a2 = a2 * alpha[:, None] + tl.dot(pb, c2)
    a3 = a3 * alpha[:, None] + tl.dot(pb, c3)
    a4 = a4 * alpha[:, None] + tl.dot(pb, c4)
    a5 = a5 * alpha[:, None] + tl.dot(pb, c5)
    a6 = a6 * alpha[:, None] + tl.dot(pb, c6)
    a7 = a7 * alpha[:, None] + tl.dot(pb, c7)
    return m_new, l_i, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _row_planes(ptr, tmask, DC: tl.constexpr, PW: tl.constexpr, RPW: tl.constexpr, DT: tl.constexpr):
    """BF16 token rows ``[c | k^R]`` (``ptr``: one pointer per token) as eight content and four RoPE
    planes in ``DT``."""
    cp = tl.arange(0, PW)[None, :]
    rp = tl.arange(0, RPW)[None, :]
    base = ptr[:, None]
    msk = tmask[:, None]
    c0 = tl.load(base + 0 * PW + cp, mask=msk, other=0.0).to(DT)
    c1 = tl.load(base + 1 * PW + cp, mask=msk, other=0.0).to(DT)
    c2 = tl.load(base + 2 * PW + cp, mask=msk, other=0.0).to(DT)
    c3 = tl.load(base + 3 * PW + cp, mask=msk, other=0.0).to(DT)
    c4 = tl.load(base + 4 * PW + cp, mask=msk, other=0.0).to(DT)
    c5 = tl.load(base + 5 * PW + cp, mask=msk, other=0.0).to(DT)
    c6 = tl.load(base + 6 * PW + cp, mask=msk, other=0.0).to(DT)
    c7 = tl.load(base + 7 * PW + cp, mask=msk, other=0.0).to(DT)
    r0 = tl.load(base + DC + 0 * RPW + rp, mask=msk, other=0.0).to(DT)
    r1 = tl.load(base + DC + 1 * RPW + rp, mask=msk, other=0.0).to(DT)
    r2 = tl.load(base + DC + 2 * RPW + rp, mask=msk, other=0.0).to(DT)
    r3 = tl.load(base + DC + 3 * RPW + rp, mask=msk, other=0.0).to(DT)
    return c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3


@triton.jit(do_not_specialize=["NS", "NSP"])
def lowbit_kernel(
    Q, QR, SQB, SQT, SQH, SRB, SRT, SRH, CW, CSM, RW, RSM, CW_PS, CSM_PS, RW_PS, RSM_PS, BT, NPAGED, KSTART, OP, LP,
    NUSED, H, MAXP, NS, NSP, scale_log2, ROWS, MAP, TRASH,
    DC: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, CBITS: tl.constexpr, ASM_OK: tl.constexpr, DT: tl.constexpr, WS: tl.constexpr,
    WR: tl.constexpr, SUB: tl.constexpr, WBLOCK_T: tl.constexpr, WSPL: tl.constexpr, WROWS: tl.constexpr,
    PLAN: tl.constexpr, SMS: tl.constexpr, MAXS: tl.constexpr, PLAN_B: tl.constexpr, QT: tl.constexpr,
):  # fmt: skip
    """``QT`` query tokens a sequence (its last ``QT``, causal among them): ``QT * H`` query rows, row ``t * H + h``;
    each row reads its own length's exact policy (pages up to its own paged tokens, the sinks and its own last
    ``WR`` tokens from the shadows), so the window programs read ``WS + WR + QT - 1`` positions.

    With shadow windows (``WS + WR > 0``) split indices ``0..WSPL-1`` of the grid read each sequence's
    window rows (BF16, exact in ``DT``) in place, ``WROWS`` window positions each (a multiple of ``WBLOCK_T``),
    and store their partials as splits ``NS..NS+WSPL-1``; the splits after them read the pages. A program with
    nothing to read (past its sequence's splits, or a window program past its sequence's window) loads nothing
    and stores only its -inf log-sum-exp. The first page split of each sequence stores how many
    page splits it has in ``NUSED`` (the combine reads those and the windows'). Queries: strides ``SQB, SQT, SQH``
    (``Q``) and ``SRB, SRT, SRH`` (``QR``) per sequence, query token and head, channels contiguous."""
    b = tl.program_id(0)
    split = tl.program_id(1) - WSPL  # negative: window program ``program_id(1)``
    hg = tl.program_id(2)
    per = 0
    if PLAN:
        nsq = tl.num_programs(0)
        per = plan_pages_per_split(NPAGED, nsq, tl.num_programs(2), NS, PAGE, WS, WR, SMS, MAXS, PLAN_B)
    n, kstart, p0, p1, used = split_pages(NPAGED, KSTART, b, tl.maximum(split, 0), NS, per, PAGE, WS, WR, PLAN)
    total = tl.load(NPAGED + b)  # with shadows, the sequence's length
    w0 = tl.program_id(1) * WROWS  # a window program's first window position
    WX: tl.constexpr = WR + QT - 1  # the recent positions the window programs read: every row's own window
    active = tl.where(split >= 0, p0 < p1, tl.minimum(total, WS + WX) > w0)
    tl.store(NUSED + b, used, mask=(split == 0) & (hg == 0))  # the combine reads this many
    PW: tl.constexpr = DC // 8  # content plane width (channels)
    RPW: tl.constexpr = DR // 4  # RoPE plane width
    NG: tl.constexpr = DC // G
    NGR: tl.constexpr = DR // G
    heads, hmask, back = query_rows(hg, H, QT, BLOCK_H)
    cp = tl.arange(0, PW)[None, :]
    rp = tl.arange(0, RPW)[None, :]
    qb = Q + query_offsets(SQB, SQT, SQH, b, heads, H)[:, None] + cp
    hm = tl.where(active, hmask, False)[:, None]
    q0 = tl.load(qb + 0 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q1 = tl.load(qb + 1 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q2 = tl.load(qb + 2 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q3 = tl.load(qb + 3 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q4 = tl.load(qb + 4 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q5 = tl.load(qb + 5 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q6 = tl.load(qb + 6 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q7 = tl.load(qb + 7 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    qrb = QR + query_offsets(SRB, SRT, SRH, b, heads, H)[:, None] + rp
    qr0 = tl.load(qrb + 0 * RPW, mask=hm, other=0.0).to(tl.float16).to(DT)
    qr1 = tl.load(qrb + 1 * RPW, mask=hm, other=0.0).to(tl.float16).to(DT)
    qr2 = tl.load(qrb + 2 * RPW, mask=hm, other=0.0).to(tl.float16).to(DT)
    qr3 = tl.load(qrb + 3 * RPW, mask=hm, other=0.0).to(tl.float16).to(DT)

    m_i, l_i, a0, a1, a2, a3 = init_state(BLOCK_H, PW)
    _, _, a4, a5, a6, a7 = init_state(BLOCK_H, PW)  # eight output planes

    if split >= 0:
        for p in range(p0, p1):
            page = tl.load(BT + b * MAXP + p).to(tl.int64)
            for t0 in tl.static_range(0, PAGE, BLOCK_T):
                rows = t0 + tl.arange(0, BLOCK_T)
                pos = p * PAGE + rows
                tmask = (pos < n) & (pos >= kstart)
                # each field's words of these tokens: page strides (``*_PS``) are the caller's, token strides
                # are the field's width (a page holds each field's tokens back to back)
                ctok = page * CSM_PS + rows * NG
                w = tl.load(CW + (page * CW_PS + rows * PW)[:, None] + cp, mask=tmask[:, None], other=0)
                if BLOCK_H <= 16:  # one [T, 8] load (at 64 heads per program: eight loads, see BENCHMARKS.md)
                    sm0, sm1, sm2, sm3, sm4, sm5, sm6, sm7 = _scales8(CSM, ctok, tmask, PW, G, BLOCK_T)
                else:
                    sm0 = _scale(CSM, ctok, tmask, 0, PW, G)
                    sm1 = _scale(CSM, ctok, tmask, 1, PW, G)
                    sm2 = _scale(CSM, ctok, tmask, 2, PW, G)
                    sm3 = _scale(CSM, ctok, tmask, 3, PW, G)
                    sm4 = _scale(CSM, ctok, tmask, 4, PW, G)
                    sm5 = _scale(CSM, ctok, tmask, 5, PW, G)
                    sm6 = _scale(CSM, ctok, tmask, 6, PW, G)
                    sm7 = _scale(CSM, ctok, tmask, 7, PW, G)
                c0, c1, c2, c3, c4, c5, c6, c7 = dequant8(
                    w, sm0, sm1, sm2, sm3, sm4, sm5, sm6, sm7, CBITS, 32 if CBITS == 4 else 16, ASM_OK
                )
                rw = tl.load(RW + (page * RW_PS + rows * RPW)[:, None] + rp, mask=tmask[:, None], other=0)
                rtok = page * RSM_PS + rows * NGR
                if NGR == 1:  # one group covers the RoPE key: one scale word for all four planes
                    rsm = _scale(RSM, rtok, tmask, 0, RPW, G)
                    r0, r1, r2, r3 = dequant4(rw, rsm, rsm, rsm, rsm, True, ASM_OK)
                else:  # plane k lies in group (k * RPW) // G
                    r0, r1, r2, r3 = dequant4(
                        rw, _scale(RSM, rtok, tmask, 0, RPW, G), _scale(RSM, rtok, tmask, 1, RPW, G),
                        _scale(RSM, rtok, tmask, 2, RPW, G), _scale(RSM, rtok, tmask, 3, RPW, G), False, ASM_OK,
                    )  # fmt: skip
                m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _attend8(
                    q0, q1, q2, q3, q4, q5, q6, q7, qr0, qr1, qr2, qr3,
                    c0.to(DT), c1.to(DT), c2.to(DT), c3.to(DT), c4.to(DT), c5.to(DT), c6.to(DT), c7.to(DT),
                    r0.to(DT), r1.to(DT), r2.to(DT), r3.to(DT), page_score_mask(tmask, pos, total, back, WS, WR, QT),
                    m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, scale_log2, DT, QT > 1,
                )  # fmt: skip
    elif WS + WR > 0:
        for t0 in range(w0, tl.minimum(tl.minimum(total, WS + WX), w0 + WROWS), WBLOCK_T):
            ptr, tmask, pos = shadow_row_pointers(
                ROWS, MAP, BT, b, MAXP, total, t0, TRASH, PAGE, SUB, WS, WX, WBLOCK_T, DC + DR
            )
            c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3 = _row_planes(ptr, tmask, DC, PW, RPW, DT)
            m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _attend8(
                q0, q1, q2, q3, q4, q5, q6, q7, qr0, qr1, qr2, qr3, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3,
                window_score_mask(tmask, pos, total, back, WS, WR, QT), m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7,
                scale_log2, DT, QT > 1,
            )  # fmt: skip

    split = tl.where(split >= 0, split, NS + tl.program_id(1))
    has = l_i > 0
    inv = (1.0 / tl.where(has, l_i, 1.0))[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LP + (b * NSP + split) * (QT * H) + heads, lse, mask=hmask)
    ob = OP + ((b * NSP + split) * (QT * H) + heads)[:, None] * DC + cp  # hm: not for a program without tokens
    tl.store(ob + 0 * PW, a0 * inv, mask=hm)
    tl.store(ob + 1 * PW, a1 * inv, mask=hm)
    tl.store(ob + 2 * PW, a2 * inv, mask=hm)
    tl.store(ob + 3 * PW, a3 * inv, mask=hm)
    tl.store(ob + 4 * PW, a4 * inv, mask=hm)
    tl.store(ob + 5 * PW, a5 * inv, mask=hm)
    tl.store(ob + 6 * PW, a6 * inv, mask=hm)
    tl.store(ob + 7 * PW, a7 * inv, mask=hm)
