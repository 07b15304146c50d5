"""The low-bit decode kernel with both products transposed onto Hopper's warpgroup MMA (Gluon).

Experimental, GPU only (Gluon has no CPU interpreter); ``decode_variants.py --only wgmma`` checks it
against the library kernel on the same cache before timing it, and ``tests/benchmarks`` against the
fp32 reference. It reads the library's own packing (group-planar words, :mod:`quantmla.kernels.layout`).
Measured on the H200 at h=16, B=32, 64K: 640.4 / 605.3 us (C4R4 / C2R4) against the library kernel's
644.8 / 560.1 in the same run (``BENCHMARKS.md``): level for INT4, behind for INT2, so it is not wired
into the library.

With 16 heads the tensor-core products are tall along the tokens, so both run transposed, with the
64 tokens (or channels) on the 64-row side of ``wgmma``:

* ``s^T = c q^T``: ``c`` [64 tokens, 576] is the A operand *in registers*. The page's words arrive by
  cp.async in a swizzled shared stage (the next page's copy overlaps this page's work); each thread
  loads the words of its own A-fragment elements as 16-byte vectors (the fragment's channel order is
  permuted so that a thread's four channels are four consecutive words; the relabelling is a register
  renaming) and unpacks them in place, two planes at a time; ``q^T`` is the B operand in shared
  memory, written once per program in the same permuted channel order.
* ``o^T += c^T p^T``: the unpacked fp16 tile is stored once to shared memory and read back by the
  tensor cores as a transposed A operand; ``p^T`` is a 2 KB B operand.

So the fp16 tile crosses shared memory once each way (the library kernel's Triton lowering writes it
once and reads it twice, and re-reads the queries every tile), and the products issue half the
tensor-core instructions of ``mma.sync``. The output rows come out in the permuted channel order and
are stored to their channels.
"""

from __future__ import annotations

from decode_gluon import split_pages
from decode_variants import half_word_source
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from quantmla.kernels.unpack import R4_ASM, R4_CONS, code_lines, scale_split_lines

_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# cp.async into shared memory: ``async_load`` in newer Triton, ``async_copy_global_to_shared`` in 3.6
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def planes_asm(word_bits: int, bits: int, first: int, count: int) -> tuple[str, str]:
    """PTX: planes ``first .. first + count - 1`` of a pair of words of one token (two 32-bit words,
    or two 16-bit words in one register) to ``count`` ``f16x2`` registers, each plane with its own
    int32 scale|minimum word (with ``pack=2`` each arrives as two equal registers)."""
    P = count
    pre, src, s0 = half_word_source(word_bits, bits, first, count)
    lines = ["{", f".reg .b32 hw, v, c, s<{P}>, m<{P}>;", ".reg .b16 sl, mh;", *pre]
    for i in range(P):
        lines += scale_split_lines(f"${s0 + 2 * i}", f"s{i}", f"m{i}")
    codes = range(first % (16 // bits), first % (16 // bits) + count)
    lines += code_lines(src, codes, bits, [f"${i}" for i in range(P)], [f"s{i}" for i in range(P)],
                        [f"m{i}" for i in range(P)])  # fmt: skip
    lines.append("}")
    return "\n".join(lines), ",".join(["=r"] * P + ["r"] * ((2 if word_bits == 32 else 1) + 2 * P))


_D = {(w, bt, k): planes_asm(w, bt, 2 * k, 2) for w, bt in ((32, 4), (16, 2)) for k in range(4)}
# the PTX of step K (planes 2K, 2K + 1) and its constraints, for INT4 and INT2 words
D4 = gl.constexpr(tuple(gl.constexpr(_D[32, 4, k][0]) for k in range(4)))
D4_C = gl.constexpr(tuple(gl.constexpr(_D[32, 4, k][1]) for k in range(4)))
D2 = gl.constexpr(tuple(gl.constexpr(_D[16, 2, k][0]) for k in range(4)))
D2_C = gl.constexpr(tuple(gl.constexpr(_D[16, 2, k][1]) for k in range(4)))


@gluon.jit
def _perm(j):
    """Channel (word) of fragment column ``j``: in each 16-column step, thread quad ``r`` holds
    columns ``2r, 2r+1, 2r+8, 2r+9``, mapped to words ``4r .. 4r+3``."""
    jj = j % 16
    return (j // 16) * 16 + 4 * ((jj % 8) // 2) + 2 * (jj // 8) + jj % 2


@gluon.jit
def _to_fragment(x, la: gl.constexpr):
    """Relabel a ``[64, NW]`` tile in words order as fragment columns (``_perm``): a register renaming."""
    NW: gl.constexpr = x.shape[1]
    y = gl.reshape(x, [64, NW // 16, 4, 2, 2])
    y = gl.permute(y, (0, 1, 3, 2, 4))
    y = gl.reshape(y, [64, NW])
    return gl.convert_layout(y, la, assert_trivial=True)


@gluon.jit
def _issue(cw_s, rw_s, sm_s, CW, RW, CSM, RSM, page, p, n, kstart, PW: gl.constexpr, RPW: gl.constexpr,
           NG: gl.constexpr, CBITS: gl.constexpr):  # fmt: skip
    """cp.async of page ``page`` (logical page ``p``) into the stage: words, RoPE words, scale words
    (rows 0-7 content groups, row 8 RoPE); tokens outside ``[kstart, n)`` are zero-filled."""
    VEC: gl.constexpr = 4 if CBITS == 4 else 8
    cl: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (PW // VEC), PW // VEC], [4, 1], [1, 0])
    rl: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    sl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, cl)), 1)
    e = gl.expand_dims(gl.arange(0, PW, layout=gl.SliceLayout(0, cl)), 0)
    ok = ((p * 64 + t) < n) & ((p * 64 + t) >= kstart) & (e >= 0)
    _async_load(cw_s, CW + (page * 64 + t) * PW + e, mask=ok)
    t = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, rl)), 1)
    e = gl.expand_dims(gl.arange(0, RPW, layout=gl.SliceLayout(0, rl)), 0)
    ok = ((p * 64 + t) < n) & ((p * 64 + t) >= kstart) & (e >= 0)
    _async_load(rw_s, RW + (page * 64 + t) * RPW + e, mask=ok)
    i = gl.arange(0, NG * 64, layout=sl)  # content scale words, group-major: row g = i // 64, token t
    g = i // 64
    t = i % 64
    ok = ((p * 64 + t) < n) & ((p * 64 + t) >= kstart)
    _async_load(sm_s.slice(0, NG * 64), CSM + (page * 64 + t) * NG + g, mask=ok)
    t = gl.arange(0, 64, layout=sl)  # 64 RoPE scale words over 128 threads: replicated
    ok = ((p * 64 + t) < n) & ((p * 64 + t) >= kstart)
    _async_load(sm_s.slice(NG * 64, 64), RSM + page * 64 + t, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _bsm(sm_s, k: gl.constexpr, like):
    """The scale|minimum words of scale row ``k`` of the stage, broadcast like ``like``."""
    sm = sm_s.slice(k * 64, 64).load(gl.SliceLayout(1, like.type.layout))
    sm, _ = gl.broadcast(gl.expand_dims(sm, 1), like)
    return sm


@gluon.jit
def _step2(w, cw_s, sm_s, q_smem, c_smem, sT, lw: gl.constexpr, la: gl.constexpr, K: gl.constexpr,
           CBITS: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr):  # fmt: skip
    """Planes ``2K``, ``2K + 1``: unpack, ``s^T += c q^T`` (waited for), and store them for ``p c``.
    INT4 words are read from the stage again for each step (32 registers kept live across the steps
    spill the loop's addresses: measured 694.8 vs 638.6 us); INT2 words (16 registers) are passed in."""
    if CBITS == 4:
        w = cw_s.load(lw)
    ca, cb = gl.inline_asm_elementwise(
        ASM,
        CONS,
        [w, _bsm(sm_s, 2 * K, w), _bsm(sm_s, 2 * K + 1, w)],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )  # planes 2K, 2K + 1 (``planes_asm``)
    ca = _to_fragment(ca, la)
    cb = _to_fragment(cb, la)
    sT = warpgroup_mma(ca, q_smem.index(2 * K).permute((1, 0)), sT, is_async=True)
    sT = warpgroup_mma(cb, q_smem.index(2 * K + 1).permute((1, 0)), sT, is_async=True)
    c_smem.index(2 * K).store(ca)
    c_smem.index(2 * K + 1).store(cb)
    return warpgroup_mma_wait(0, deps=[sT, ca, cb])[0]


@gluon.jit
def _wgmma_lowbit_kernel(
    Q, QR, CW, CSM, RW, RSM, BT, NPAGED, KSTART, OP, LP, H, MAXP, NS, NSP, scale_log2,
    DC: gl.constexpr, DR: gl.constexpr, G: gl.constexpr, PAGE: gl.constexpr, BLOCK_T: gl.constexpr,
    BLOCK_H: gl.constexpr, CBITS: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_T == 64, "one 64-token page per wgmma tile")
    gl.static_assert(PAGE == 64, "one 64-token page per wgmma tile")
    gl.static_assert(BLOCK_H == 16, "16 heads: the N side of the transposed products")
    gl.static_assert(G == 64, "groups of 64 channels: one plane per group")
    gl.static_assert(DC == 512 and DR == 64, "the DeepSeek geometry (512 + 64)")
    b = gl.program_id(0)
    split = gl.program_id(1)
    hg = gl.program_id(2)
    NG: gl.constexpr = DC // G  # 8 content planes = groups
    PW: gl.constexpr = DC // 8  # words per token
    RPW: gl.constexpr = DR // 4
    WT: gl.constexpr = gl.int32 if CBITS == 4 else gl.int16

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # registers of the packed words: thread (quad r, row g) of warp w holds words 16 kb + 4 r .. + 3 (one
    # vector) of tokens 16 w + g and 16 w + g + 8, which unpack into its A-fragment elements
    lw: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_T, PW])  # fmt: skip
    lr: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_T, RPW])  # fmt: skip
    sw128: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sw32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    wsw: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    q_smem = gl.allocate_shared_memory(gl.float16, [NG, BLOCK_H, G], sw128)
    qr_smem = gl.allocate_shared_memory(gl.float16, [4, BLOCK_H, 16], sw32)
    c_smem = gl.allocate_shared_memory(gl.float16, [NG, BLOCK_T, G], sw128)
    p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_T], sw128)
    cw_s = gl.allocate_shared_memory(WT, [BLOCK_T, PW], wsw)
    rw_s = gl.allocate_shared_memory(gl.int16, [BLOCK_T, RPW], flat)
    sm_s = gl.allocate_shared_memory(gl.int32, [16 * BLOCK_T], flat1)

    n, kstart, p0, p1 = split_pages(NPAGED, KSTART, b, split, NS, PAGE)
    if p0 < p1:
        _issue(cw_s, rw_s, sm_s, CW, RW, CSM, RSM, gl.load(BT + b * MAXP + p0).to(gl.int64), p0, n, kstart,
               PW, RPW, NG, CBITS)  # fmt: skip

    # queries, once per program, in the fragments' permuted channel order
    hq = gl.expand_dims(gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ql)), 1)
    jq = gl.expand_dims(gl.arange(0, G, layout=gl.SliceLayout(0, ql)), 0)
    qm = (hg * BLOCK_H + hq) < H
    qrow = (b * H + hg * BLOCK_H + hq).to(gl.int64)
    for g in gl.static_range(NG):
        qv = gl.load(Q + qrow * DC + g * G + _perm(jq), mask=qm & (jq >= 0), other=0.0)
        q_smem.index(g).store(qv.to(gl.float16))
    jr = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, ql)), 0)
    for k in gl.static_range(4):
        qv = gl.load(QR + qrow * DR + k * 16 + _perm(jr), mask=qm & (jr >= 0), other=0.0)
        qr_smem.index(k).store(qv.to(gl.float16))
    fence_async_shared()

    ts = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, mma))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_part = gl.zeros([BLOCK_T, BLOCK_H], gl.float32, layout=mma)
    o0 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o1 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o2 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o3 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o4 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o5 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o6 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    o7 = gl.zeros([G, BLOCK_H], gl.float32, layout=mma)
    for p in range(p0, p1):
        async_copy.wait_group(0)
        _barrier()  # this page's stage has landed for every thread
        w = cw_s.load(lw) if CBITS == 2 else 0
        rw = rw_s.load(lr)
        r0, r1, r2, r3 = gl.inline_asm_elementwise(R4_ASM, R4_CONS, [rw, _bsm(sm_s, NG, rw)],
                                                   dtype=(gl.float16,) * 4, is_pure=True, pack=2)  # fmt: skip
        r0 = _to_fragment(r0, la)
        r1 = _to_fragment(r1, la)
        r2 = _to_fragment(r2, la)
        r3 = _to_fragment(r3, la)
        sT = gl.zeros([BLOCK_T, BLOCK_H], gl.float32, layout=mma)
        sT = warpgroup_mma(r0, qr_smem.index(0).permute((1, 0)), sT, is_async=True)
        sT = warpgroup_mma(r1, qr_smem.index(1).permute((1, 0)), sT, is_async=True)
        sT = warpgroup_mma(r2, qr_smem.index(2).permute((1, 0)), sT, is_async=True)
        sT = warpgroup_mma(r3, qr_smem.index(3).permute((1, 0)), sT, is_async=True)
        # two planes per step: with four, the live fragments spill (measured 1.37x slower)
        for K in gl.static_range(4):
            if K == 1:  # the RoPE products' fragments are free once the first step has been issued
                sT = warpgroup_mma_wait(0, deps=[sT, r0, r1, r2, r3])[0]
            sT = _step2(w, cw_s, sm_s, q_smem, c_smem, sT, lw, la, K, CBITS, D4[K] if CBITS == 4 else D2[K],
                        D4_C[K] if CBITS == 4 else D2_C[K])  # fmt: skip
        _barrier()  # every thread has read the stage: prefetch the next page into it
        if p + 1 < p1:
            _issue(cw_s, rw_s, sm_s, CW, RW, CSM, RSM, gl.load(BT + b * MAXP + p + 1).to(gl.int64), p + 1, n, kstart,
                   PW, RPW, NG, CBITS)  # fmt: skip

        tms = gl.expand_dims(((p * PAGE + ts) < n) & ((p * PAGE + ts) >= kstart), 1)
        qk = gl.where(tms, sT * scale_log2, float("-inf"))
        m_tile = gl.max(qk, 0)
        m_new = gl.maximum(m_i, m_tile)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from a fully masked first tile
        al = gl.expand_dims(gl.exp2(m_i - m_use), 0)
        pT = gl.exp2(qk - gl.expand_dims(m_use, 0))
        l_part = l_part * al + pT  # the row sums, reduced across warps once at the end
        o0 = o0 * al
        o1 = o1 * al
        o2 = o2 * al
        o3 = o3 * al
        o4 = o4 * al
        o5 = o5 * al
        o6 = o6 * al
        o7 = o7 * al
        m_i = m_new
        p_smem.store(gl.permute(pT.to(gl.float16), (1, 0)))
        fence_async_shared()
        _barrier()  # the tile and p are in shared memory for every warp
        pB = p_smem.permute((1, 0))
        o0 = warpgroup_mma(c_smem.index(0).permute((1, 0)), pB, o0, is_async=True)
        o1 = warpgroup_mma(c_smem.index(1).permute((1, 0)), pB, o1, is_async=True)
        o2 = warpgroup_mma(c_smem.index(2).permute((1, 0)), pB, o2, is_async=True)
        o3 = warpgroup_mma(c_smem.index(3).permute((1, 0)), pB, o3, is_async=True)
        o4 = warpgroup_mma(c_smem.index(4).permute((1, 0)), pB, o4, is_async=True)
        o5 = warpgroup_mma(c_smem.index(5).permute((1, 0)), pB, o5, is_async=True)
        o6 = warpgroup_mma(c_smem.index(6).permute((1, 0)), pB, o6, is_async=True)
        o7 = warpgroup_mma(c_smem.index(7).permute((1, 0)), pB, o7, is_async=True)
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])

    l_i = gl.sum(l_part, 0)
    has = l_i > 0
    inv = gl.expand_dims(1.0 / gl.where(has, l_i, 1.0), 0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    hv = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma))
    gl.store(LP + (b * NSP + split) * H + hg * BLOCK_H + hv, lse, mask=(hg * BLOCK_H + hv) < H)
    ho = gl.expand_dims(hv, 0)
    jo = gl.expand_dims(_perm(gl.arange(0, G, layout=gl.SliceLayout(1, mma))), 1)
    ob = OP + ((b * NSP + split) * H + hg * BLOCK_H + ho).to(gl.int64) * DC + jo
    om = ((hg * BLOCK_H + ho) < H) & (jo >= 0)
    gl.store(ob + 0 * G, o0 * inv, mask=om)
    gl.store(ob + 1 * G, o1 * inv, mask=om)
    gl.store(ob + 2 * G, o2 * inv, mask=om)
    gl.store(ob + 3 * G, o3 * inv, mask=om)
    gl.store(ob + 4 * G, o4 * inv, mask=om)
    gl.store(ob + 5 * G, o5 * inv, mask=om)
    gl.store(ob + 6 * G, o6 * inv, mask=om)
    gl.store(ob + 7 * G, o7 * inv, mask=om)
