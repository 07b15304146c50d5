"""The sliced low-bit decode kernel of ``decode_variants.py`` written in Gluon (Triton's explicit-layout
dialect), so that nothing goes through shared memory except the cross-warp sum of the scores.

Experimental, GPU only (Gluon has no CPU interpreter): ``decode_variants.py`` checks it against the
library kernel on the same cache before timing it. Each of the 4 warps owns a 128-channel slice of the
latent (slice-planar packing, :func:`decode_variants.repack`). The packed words are loaded from global
memory straight into the register layout of the ``mma.sync`` B operand of ``q c^T`` (the pair of values
along channels) and unpacked there by the same PTX as the Triton sliced kernel, once; the B operand of
``p c`` (the pair along tokens) is the same registers with each 8x8 block transposed inside the warp by
``movmatrix`` (:func:`_transpose_blocks`). A page is processed in sub-tiles of 32 tokens, so that a
sub-tile's fp16 values stay in registers between the two products. (Unpacking twice, once per
product's layout, measured 726.3 / 686.1 us for C4R4 / C2R4; this version 670.9 / 631.5 us, against
the library kernel's 645.9 / 560.7 in the same run: ``BENCHMARKS.md``.)
"""

from __future__ import annotations

from decode_variants import C2_HI, C2_HI_C, C2_LO, C2_LO_C, C4_HI, C4_HI_C, C4_LO, C4_LO_C, R4_0, R4_0_C
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# a CTA barrier: ``gl.barrier`` in newer Triton, ``gl.thread_barrier`` in the GPU image's 3.6
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _idx3(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, layout: gl.constexpr):
    """Index tensors ``[n0,1,1]``, ``[1,n1,1]``, ``[1,1,n2]`` in ``layout``."""
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    i2 = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    return (
        gl.expand_dims(gl.expand_dims(i0, 1), 2),
        gl.expand_dims(gl.expand_dims(i1, 0), 2),
        gl.expand_dims(gl.expand_dims(i2, 0), 1),
    )


@gluon.jit
def _idx2(n0: gl.constexpr, n1: gl.constexpr, layout: gl.constexpr):
    """Index tensors ``[n0,1]``, ``[1,n1]`` in the 2-D ``layout``."""
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, layout))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims(i0, 1), gl.expand_dims(i1, 0)


@gluon.jit
def split_pages(NPAGED, KSTART, b, split, NS, PAGE: gl.constexpr):
    """Paged-token count, left-padding start and the page range ``[p0, p1)`` of one split."""
    n = gl.load(NPAGED + b)
    kstart = gl.load(KSTART + b)
    npages = gl.cdiv(n, PAGE)
    per = gl.cdiv(npages, NS)
    p0 = split * per
    return n, kstart, p0, gl.minimum(p0 + per, npages)


@gluon.jit
def _planes4(w, sm, HI: gl.constexpr, CBITS: gl.constexpr):
    if CBITS == 4:
        if HI == 0:
            return gl.inline_asm_elementwise(C4_LO, C4_LO_C, [w, sm], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
        return gl.inline_asm_elementwise(C4_HI, C4_HI_C, [w, sm], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
    if HI == 0:
        return gl.inline_asm_elementwise(C2_LO, C2_LO_C, [w, sm], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
    return gl.inline_asm_elementwise(C2_HI, C2_HI_C, [w, sm], dtype=(gl.float16,) * 4, is_pure=True, pack=2)


MOVT = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")


@gluon.jit
def _transpose_blocks(c, lb: gl.constexpr):
    """``c [NSL, 16 channels, T tokens]``, the ``q c^T`` B operand (pairs along channels), as the
    ``p c`` B operand ``[NSL, T, 16]`` (pairs along tokens): ``movmatrix`` transposes each 8x8 block
    held by the warp, which leaves block (channels cb, tokens tb) holding at (i, j) the value of
    token 8 tb + i, channel 8 cb + j; the rest is a relabelling of registers."""
    NSL: gl.constexpr = c.shape[0]
    T: gl.constexpr = c.shape[2]
    y = gl.inline_asm_elementwise(MOVT, "=r,r", [c], dtype=gl.float16, is_pure=True, pack=2)
    y = gl.permute(gl.reshape(y, [NSL, 2, 8, T // 8, 8]), (0, 3, 2, 1, 4))  # (slice, tb, i, cb, j)
    return gl.convert_layout(gl.reshape(y, [NSL, T, 16]), lb, assert_trivial=True)


@gluon.jit
def _gluon_sliced_kernel(
    Q, QR, CW, CSM, RW, RSM, BT, NPAGED, KSTART, OP, LP, H, MAXP, NS, NSP, scale_log2,
    DC: gl.constexpr, DR: gl.constexpr, G: gl.constexpr, PAGE: gl.constexpr, BLOCK_T: gl.constexpr,
    BLOCK_H: gl.constexpr, CBITS: gl.constexpr, SUB: gl.constexpr = 32,
):  # fmt: skip
    """One page per iteration, in sub-tiles of ``SUB`` tokens: unpack once, ``q c^T``, the scores summed
    across the slices, softmax, then ``p c`` on the same fp16 values transposed by ``movmatrix``."""
    gl.static_assert(BLOCK_T == PAGE, "one page per iteration, in sub-tiles of SUB tokens")
    b = gl.program_id(0)
    split = gl.program_id(1)
    hg = gl.program_id(2)
    NSL: gl.constexpr = 4
    SW: gl.constexpr = DC // NSL
    PW: gl.constexpr = SW // 8
    NG: gl.constexpr = DC // G
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # the slices' partial scores are summed through shared memory, swizzled so that neither the mma
    # layout's stores nor the row-wise loads conflict; each warp then owns 4 of the 16 head rows
    red: gl.constexpr = gl.BlockedLayout([NSL, 1, SUB // 32], [1, 1, 32], [1, 4, 1], [2, 1, 0])
    sm: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[2, 1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, red))  # [BLOCK_H] vectors
    cols_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, red))  # [SUB] vectors
    acc_rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, mma))
    buf = gl.allocate_shared_memory(gl.float32, [NSL, BLOCK_H, SUB], sm)
    pz = gl.zeros([NSL, BLOCK_H, SUB], gl.float16, layout=la)

    # queries: A operands [NSL, BLOCK_H, PW], one per 16-channel plane of each slice
    s_a, h_a, e_a = _idx3(NSL, BLOCK_H, PW, la)
    heads_a = hg * BLOCK_H + h_a
    qm = (heads_a < H) & (s_a >= 0) & (e_a >= 0)
    qb = Q + (b * H + heads_a) * DC + s_a * SW + e_a
    q0 = gl.load(qb + 0 * PW, mask=qm, other=0.0).to(gl.float16)
    q1 = gl.load(qb + 1 * PW, mask=qm, other=0.0).to(gl.float16)
    q2 = gl.load(qb + 2 * PW, mask=qm, other=0.0).to(gl.float16)
    q3 = gl.load(qb + 3 * PW, mask=qm, other=0.0).to(gl.float16)
    q4 = gl.load(qb + 4 * PW, mask=qm, other=0.0).to(gl.float16)
    q5 = gl.load(qb + 5 * PW, mask=qm, other=0.0).to(gl.float16)
    q6 = gl.load(qb + 6 * PW, mask=qm, other=0.0).to(gl.float16)
    q7 = gl.load(qb + 7 * PW, mask=qm, other=0.0).to(gl.float16)
    qr = gl.load(QR + (b * H + heads_a) * DR + s_a * PW + e_a, mask=qm, other=0.0).to(gl.float16)

    # B operand of q c^T: [NSL, PW, SUB] (pairs along channels)
    s_q, e_q, t_q = _idx3(NSL, PW, SUB, lb)
    # per-(slice, token) scale words, loaded once per token and broadcast over the channels
    s_q2, t_q2 = _idx2(NSL, SUB, gl.SliceLayout(1, lb))
    tt = gl.arange(0, SUB, layout=cols_l)

    n, kstart, p0, p1 = split_pages(NPAGED, KSTART, b, split, NS, PAGE)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=rows_l)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=rows_l)
    a0 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a1 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a2 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a3 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a4 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a5 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a6 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    a7 = gl.zeros([NSL, BLOCK_H, PW], gl.float32, layout=mma)
    for p in range(p0, p1):
        page = gl.load(BT + b * MAXP + p).to(gl.int64)
        for t0 in gl.static_range(0, PAGE, SUB):  # sub-tiles: the tile's fp16 values stay in registers
            # q c^T: words, scales and RoPE words in the B layout with pairs along channels
            tq = p * PAGE + t0 + t_q
            mq = (tq < n) & (tq >= kstart) & (s_q >= 0) & (e_q >= 0)
            tokq = page * PAGE + t0 + t_q
            w = gl.load(CW + (tokq * NSL + s_q) * PW + e_q, mask=mq, other=0)
            tq2 = p * PAGE + t0 + t_q2
            mq2 = (tq2 < n) & (tq2 >= kstart) & (s_q2 >= 0)
            tokq2 = page * PAGE + t0 + t_q2
            smq = CSM + tokq2 * NG + (s_q2 * SW) // G  # group of planes 0-3; planes 4-7: the next group
            sa, _ = gl.broadcast(gl.expand_dims(gl.load(smq, mask=mq2, other=0), 1), w)
            sb, _ = gl.broadcast(gl.expand_dims(gl.load(smq + (4 * PW) // G, mask=mq2, other=0), 1), w)
            rsm, _ = gl.broadcast(gl.expand_dims(gl.load(RSM + tokq2 + s_q2 * 0, mask=mq2, other=0), 1), w)
            rw = gl.load(RW + tokq * (DR // 4) + e_q + s_q * 0, mask=mq, other=0)
            rw = rw >> (4 * s_q + e_q * 0).to(gl.int16)
            r = gl.inline_asm_elementwise(R4_0, R4_0_C, [rw, rsm], dtype=gl.float16, is_pure=True, pack=2)
            c0, c1, c2, c3 = _planes4(w, sa, 0, CBITS)
            s3 = mma_v2(q0, c0, gl.zeros([NSL, BLOCK_H, SUB], gl.float32, layout=mma))
            s3 = mma_v2(q1, c1, s3)
            s3 = mma_v2(q2, c2, s3)
            s3 = mma_v2(q3, c3, s3)
            c4, c5, c6, c7 = _planes4(w, sb, 1, CBITS)
            s3 = mma_v2(q4, c4, s3)
            s3 = mma_v2(q5, c5, s3)
            s3 = mma_v2(q6, c6, s3)
            s3 = mma_v2(q7, c7, s3)
            s3 = mma_v2(qr, r, s3)
            buf.store(s3)
            _barrier()
            qk = gl.sum(buf.load(red), 0) * scale_log2  # the slices' partial scores, summed
            _barrier()  # every warp has read before the next tile's store
            tm = gl.expand_dims(((p * PAGE + t0 + tt) < n) & ((p * PAGE + t0 + tt) >= kstart), 0)
            qk = gl.where(tm, qk, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(qk, 1))
            alpha = gl.exp2(m_i - m_new)
            pr = gl.exp2(qk - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(pr, 1)
            p3, _ = gl.broadcast(gl.expand_dims(gl.convert_layout(pr.to(gl.float16), gl.SliceLayout(0, la)), 0), pz)
            al3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(alpha, acc_rows), 1), 0)
            # p c: the same fp16 values, each 8x8 block transposed inside the warp (movmatrix)
            a0 = mma_v2(p3, _transpose_blocks(c0, lb), a0 * al3)
            a1 = mma_v2(p3, _transpose_blocks(c1, lb), a1 * al3)
            a2 = mma_v2(p3, _transpose_blocks(c2, lb), a2 * al3)
            a3 = mma_v2(p3, _transpose_blocks(c3, lb), a3 * al3)
            a4 = mma_v2(p3, _transpose_blocks(c4, lb), a4 * al3)
            a5 = mma_v2(p3, _transpose_blocks(c5, lb), a5 * al3)
            a6 = mma_v2(p3, _transpose_blocks(c6, lb), a6 * al3)
            a7 = mma_v2(p3, _transpose_blocks(c7, lb), a7 * al3)
            m_i = m_new

    has = l_i > 0
    inv = gl.expand_dims(gl.expand_dims(gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), acc_rows), 1), 0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    heads = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=rows_l)
    gl.store(LP + (b * NSP + split) * H + heads, lse, mask=heads < H)
    s_o, h_o, e_o = _idx3(NSL, BLOCK_H, PW, mma)
    heads_o = hg * BLOCK_H + h_o
    om = (heads_o < H) & (s_o >= 0) & (e_o >= 0)
    ob = OP + ((b * NSP + split) * H + heads_o) * DC + s_o * SW + e_o
    gl.store(ob + 0 * PW, a0 * inv, mask=om)
    gl.store(ob + 1 * PW, a1 * inv, mask=om)
    gl.store(ob + 2 * PW, a2 * inv, mask=om)
    gl.store(ob + 3 * PW, a3 * inv, mask=om)
    gl.store(ob + 4 * PW, a4 * inv, mask=om)
    gl.store(ob + 5 * PW, a5 * inv, mask=om)
    gl.store(ob + 6 * PW, a6 * inv, mask=om)
    gl.store(ob + 7 * PW, a7 * inv, mask=om)
