"""Kernel-structure experiments for the low-bit decode kernel (issue 6), side by side on the H200.

Not the library's kernel: this script keeps the experiments that BENCHMARKS.md reports ("Where the
targets stand") runnable, so their figures can be reproduced and the next attempt starts from them.

* **launch variants of the library kernel** (``quantmla.kernels.decode_lowbit``): warps, pipelining
  stages, a register cap (``maxnreg``, for more resident blocks per SM) and programs per SM;
* **the sliced kernel** below: each of the 4 warps owns a 128-channel slice of the latent. ``q c^T``
  is split over the slices (a batched dot, warps on the batch dimension; the 4 partial score tiles
  are summed across warps) and each warp accumulates ``p c`` for its own slice, so the dequantised
  fp16 tile never goes through shared memory: each warp unpacks its slice twice, straight into the
  register layouts of the two products. It needs its own packing (slice-planar words: word ``e`` of
  slice ``s`` holds channel ``128 s + 16 k + e`` at bit ``bits * k``); :func:`repack` converts a
  store's content.

    PYTHONPATH=src:benchmarks python benchmarks/decode_variants.py          # H200: check, then time
    PYTHONPATH=src:benchmarks python benchmarks/kernel_sass.py --loop       # what the compiler made

Each variant is checked against the library kernel on the same cache (awkward lengths 1000/5/777)
before it is timed; timings are do_bench medians with L2 flushed, in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import triton
import triton.language as tl

from quantmla.kernels.decode import _split_pages, combine_splits
from quantmla.kernels.layout import CONTENT_PLANES, pack_words, unpack_words
from quantmla.kernels.unpack import _plane_ref, code_lines

SLICES = 4  # one per warp


def half_word_source(word_bits: int, bits: int, first: int, count: int) -> tuple[list[str], str, int]:
    """The common start of the unpack PTX of ``count`` codes from ``first`` of a pair of words (operands
    ``$count..``): the codes must lie in one half-word; for 32-bit words a ``prmt`` gathers that half
    of both words into ``hw``. Returns ``(lines, source register, first operand after the words)``."""
    half, j0 = divmod(first, 16 // bits)
    if j0 + count > 16 // bits:
        raise ValueError("the codes of one call must lie in one half-word")
    if word_bits == 32:
        return [f"prmt.b32 hw, ${count}, ${count + 1}, {0x5410 if half == 0 else 0x7632:#x};"], "hw", count + 2
    return [], f"${count}", count + 1


def slice_asm(word_bits: int, bits: int, first: int, count: int) -> tuple[str, str]:
    """PTX: codes ``first .. first + count - 1`` of a pair of words (one half of each 32-bit word, or a
    16-bit word each) to ``count`` f16x2 registers, with each pair element's own scale and minimum
    (its int32 scale|minimum word), so the pair may span two tokens."""
    P = count
    pre, src, sm = half_word_source(word_bits, bits, first, count)
    lines = ["{", ".reg .b32 hw, v, c, s, m;", *pre]
    lines += [f"prmt.b32 s, ${sm}, ${sm + 1}, 0x5410;", f"prmt.b32 m, ${sm}, ${sm + 1}, 0x7632;"]
    codes = range(first % (16 // bits), first % (16 // bits) + count)
    lines += code_lines(src, codes, bits, [f"${i}" for i in range(P)], ["s"] * P, ["m"] * P)
    lines.append("}")
    return "\n".join(lines), ",".join(["=r"] * P + ["r"] * ((2 if word_bits == 32 else 1) + 2))


_A = {k: slice_asm(*k) for k in ((32, 4, 0, 4), (32, 4, 4, 4), (16, 2, 0, 4), (16, 2, 4, 4), (16, 4, 0, 1))}
C4_LO, C4_LO_C = tl.constexpr(_A[32, 4, 0, 4][0]), tl.constexpr(_A[32, 4, 0, 4][1])
C4_HI, C4_HI_C = tl.constexpr(_A[32, 4, 4, 4][0]), tl.constexpr(_A[32, 4, 4, 4][1])
C2_LO, C2_LO_C = tl.constexpr(_A[16, 2, 0, 4][0]), tl.constexpr(_A[16, 2, 0, 4][1])
C2_HI, C2_HI_C = tl.constexpr(_A[16, 2, 4, 4][0]), tl.constexpr(_A[16, 2, 4, 4][1])
R4_0, R4_0_C = tl.constexpr(_A[16, 4, 0, 1][0]), tl.constexpr(_A[16, 4, 0, 1][1])


@triton.jit
def _ref_plane(w, sm, k: tl.constexpr, BITS: tl.constexpr):
    """The interpreter path: the library's reference dequantisation, scale in the low half of ``sm``."""
    return _plane_ref(w, sm, k, BITS).to(tl.float32)


@triton.jit
def _planes4(w, sm, HI: tl.constexpr, CBITS: tl.constexpr, ASM_OK: tl.constexpr):
    """Four planes (0-3 or 4-7) of a slice's words, with one scale|minimum word per element."""
    if not ASM_OK:
        return (_ref_plane(w, sm, 4 * HI, CBITS), _ref_plane(w, sm, 4 * HI + 1, CBITS),
                _ref_plane(w, sm, 4 * HI + 2, CBITS), _ref_plane(w, sm, 4 * HI + 3, CBITS))  # fmt: skip
    if CBITS == 4:
        if HI == 0:
            return tl.inline_asm_elementwise(C4_LO, C4_LO_C, [w, sm], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
        return tl.inline_asm_elementwise(C4_HI, C4_HI_C, [w, sm], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    if HI == 0:
        return tl.inline_asm_elementwise(C2_LO, C2_LO_C, [w, sm], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    return tl.inline_asm_elementwise(C2_HI, C2_HI_C, [w, sm], dtype=(tl.float16,) * 4, is_pure=True, pack=2)


@triton.jit
def _rope_plane(w, sm, ASM_OK: tl.constexpr):
    if not ASM_OK:
        return _ref_plane(w, sm, 0, 4)
    return tl.inline_asm_elementwise(R4_0, R4_0_C, [w, sm], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _sliced_kernel(
    Q, QR, CW, CSM, RW, RSM, BT, NPAGED, KSTART, OP, LP, H, MAXP, NS, NSP, scale_log2,
    DC: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, CBITS: tl.constexpr, ASM_OK: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    hg = tl.program_id(2)
    NSL: tl.constexpr = 4
    SW: tl.constexpr = DC // NSL  # channels per slice
    PW: tl.constexpr = SW // 8  # plane width = words per slice and token
    NG: tl.constexpr = DC // G
    sl = tl.arange(0, NSL)[:, None, None]
    hh = hg * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
    ee = tl.arange(0, PW)[None, None, :]
    hm = hh < H
    qb = Q + (b * H + hh) * DC + sl * SW + ee
    q0 = tl.load(qb + 0 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q1 = tl.load(qb + 1 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q2 = tl.load(qb + 2 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q3 = tl.load(qb + 3 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q4 = tl.load(qb + 4 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q5 = tl.load(qb + 5 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q6 = tl.load(qb + 6 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    q7 = tl.load(qb + 7 * PW, mask=hm, other=0.0).to(tl.float16).to(DT)
    qr = tl.load(QR + (b * H + hh) * DR + sl * PW + ee, mask=hm, other=0.0).to(tl.float16).to(DT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    a0 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a1 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a2 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a3 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a4 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a5 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a6 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    a7 = tl.zeros([NSL, BLOCK_H, PW], tl.float32)
    n, kstart, p0, p1 = _split_pages(NPAGED, KSTART, b, split, NS, PAGE)
    tt = tl.arange(0, BLOCK_T)
    for p in range(p0, p1):
        page = tl.load(BT + b * MAXP + p).to(tl.int64)
        tmask = (p * PAGE + tt < n) & (p * PAGE + tt >= kstart)
        tm3 = tmask[None, :, None]
        tok3 = (page * PAGE + tt)[None, :, None]
        wptr = CW + (tok3 * NSL + sl) * PW + ee
        w = tl.load(wptr, mask=tm3, other=0)
        sa = tl.load(CSM + tok3 * NG + (sl * SW) // G, mask=tm3, other=0)
        sb = tl.load(CSM + tok3 * NG + (sl * SW + 4 * PW) // G, mask=tm3, other=0)
        rw = tl.load(RW + tok3 * (DR // 4) + ee + sl * 0, mask=tm3, other=0)
        rw = rw >> (4 * sl).to(tl.int16)  # this slice's RoPE plane to bits 0-3
        rsm = tl.load(RSM + tok3 + sl * 0, mask=tm3, other=0)
        r = _rope_plane(rw, rsm, ASM_OK).to(DT)
        c0, c1, c2, c3 = _planes4(w, sa, 0, CBITS, ASM_OK)
        s3 = tl.dot(q0, tl.trans(c0.to(DT), (0, 2, 1)))
        s3 += tl.dot(q1, tl.trans(c1.to(DT), (0, 2, 1)))
        s3 += tl.dot(q2, tl.trans(c2.to(DT), (0, 2, 1)))
        s3 += tl.dot(q3, tl.trans(c3.to(DT), (0, 2, 1)))
        c4, c5, c6, c7 = _planes4(w, sb, 1, CBITS, ASM_OK)
        s3 += tl.dot(q4, tl.trans(c4.to(DT), (0, 2, 1)))
        s3 += tl.dot(q5, tl.trans(c5.to(DT), (0, 2, 1)))
        s3 += tl.dot(q6, tl.trans(c6.to(DT), (0, 2, 1)))
        s3 += tl.dot(q7, tl.trans(c7.to(DT), (0, 2, 1)))
        s3 += tl.dot(qr, tl.trans(r, (0, 2, 1)))
        qk = tl.sum(s3, 0)  # the slices' partial scores, summed across warps
        qk = tl.where(tmask[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        p3 = tl.broadcast_to(pr.to(tl.float16).to(DT)[None, :, :], [NSL, BLOCK_H, BLOCK_T])
        al3 = alpha[None, :, None]
        # the same words again (a second load, not CSE'd), unpacked in the P.V operand's layout
        w2 = tl.load(wptr, mask=tm3, other=0, cache_modifier=".cg")
        v0, v1, v2, v3 = _planes4(w2, sa, 0, CBITS, ASM_OK)
        a0 = a0 * al3 + tl.dot(p3, v0.to(DT))
        a1 = a1 * al3 + tl.dot(p3, v1.to(DT))
        a2 = a2 * al3 + tl.dot(p3, v2.to(DT))
        a3 = a3 * al3 + tl.dot(p3, v3.to(DT))
        v4, v5, v6, v7 = _planes4(w2, sb, 1, CBITS, ASM_OK)
        a4 = a4 * al3 + tl.dot(p3, v4.to(DT))
        a5 = a5 * al3 + tl.dot(p3, v5.to(DT))
        a6 = a6 * al3 + tl.dot(p3, v6.to(DT))
        a7 = a7 * al3 + tl.dot(p3, v7.to(DT))
        m_i = m_new
    has = l_i > 0
    inv = (1.0 / tl.where(has, l_i, 1.0))[None, :, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(LP + (b * NSP + split) * H + heads, lse, mask=heads < H)
    ob = OP + ((b * NSP + split) * H + hh) * DC + sl * SW + ee
    tl.store(ob + 0 * PW, a0 * inv, mask=hm)
    tl.store(ob + 1 * PW, a1 * inv, mask=hm)
    tl.store(ob + 2 * PW, a2 * inv, mask=hm)
    tl.store(ob + 3 * PW, a3 * inv, mask=hm)
    tl.store(ob + 4 * PW, a4 * inv, mask=hm)
    tl.store(ob + 5 * PW, a5 * inv, mask=hm)
    tl.store(ob + 6 * PW, a6 * inv, mask=hm)
    tl.store(ob + 7 * PW, a7 * inv, mask=hm)


def repack(store) -> torch.Tensor:
    """A store's content codes in the sliced kernel's packing (slice-planar words)."""
    lay = store.layout
    if lay.kv_lora_rank != 512 or lay.rope_dim != 64 or lay.group_size != 64:
        raise ValueError("the sliced kernel is written for the DeepSeek geometry (512 + 64, groups of 64)")
    out = torch.empty_like(store.content)
    for i in range(0, store.content.shape[0], 4096):
        codes = unpack_words(store.content[i : i + 4096], lay.content_bits, CONTENT_PLANES)
        sliced = codes.view(*codes.shape[:-1], SLICES, lay.kv_lora_rank // SLICES)
        out[i : i + 4096] = pack_words(sliced, lay.content_bits, 8).flatten(-2)
    return out


def launch(kernel, q, qr, store, content, bt, n_paged, scale, num_splits, warps, stages, maxnreg=None):
    """One paged pass of ``kernel`` (the library's ``_lowbit_kernel``, ``_sliced_kernel`` or the Gluon one, reading
    ``content``) and the combine pass; no window. Returns ``(o [B, H, d_c] bf16, lse [B, H])``."""
    lay = store.layout
    B, H, DC = q.shape
    dev = q.device
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    op = torch.empty(B, num_splits, H, DC, dtype=torch.float32, device=dev)
    lp = torch.empty(B, num_splits, H, dtype=torch.float32, device=dev)
    _, csm, rw, rsm = store.kernel_views()
    cw = content.view(torch.int32 if lay.content_bits == 4 else torch.int16)
    kw = {} if interpret else dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    if not type(kernel).__module__.startswith("triton.experimental"):  # Triton kernels; Gluon ones take neither
        kw.update(ASM_OK=not interpret, DT=tl.float32 if interpret else tl.float16)
    kernel[(B, num_splits, 1)](
        q, qr, cw, csm, rw, rsm, bt, n_paged, torch.zeros(B, dtype=torch.int32, device=dev), op, lp, H,
        bt.shape[1], num_splits, num_splits, scale * 1.4426950408889634, DC=DC, DR=lay.rope_dim, G=lay.group_size,
        PAGE=lay.page_size, BLOCK_T=lay.page_size, BLOCK_H=16, CBITS=lay.content_bits, **kw,
    )  # fmt: skip
    return combine_splits(op, lp)


# (kernel, warps, stages, maxnreg): the library kernel's launch variants, the sliced
# kernel (Triton, Gluon) and the transposed warpgroup-MMA kernel (Gluon, decode_wgmma.py)
VARIANTS = [("lib", 4, 1, None), ("lib", 8, 1, None), ("lib", 8, 1, 128), ("lib", 4, 1, 168), ("lib", 4, 2, None),
            ("sliced", 4, 1, None), ("sliced", 4, 2, None), ("gluon", 4, 1, None), ("wgmma", 4, 1, None)]  # fmt: skip


def main() -> None:
    from decode_attention import bench, copy_bandwidth_gbs, random_store, splits_for

    from quantmla.kernels.decode import mla_decode
    from quantmla.kernels.decode_lowbit import _lowbit_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--per-sm", type=float, nargs="*", default=[8.0], help="programs per SM (library default 8)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated kernel names to run (lib, sliced, gluon, wgmma)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1 / math.sqrt(192)
    rows, res = [], {"copy_gbs": copy_bandwidth_gbs()}
    for scheme in ("c4r4", "c2r4"):
        for B, L in ((3, 1000), (32, 65536)):
            store, bt, n_paged = random_store(scheme, B, L, gen)
            if B == 3:
                n_paged = torch.tensor([1000, 5, 777], dtype=torch.int32, device="cuda")
            sliced = repack(store)
            q = torch.randn(B, 16, 512, device="cuda", generator=gen).bfloat16()
            qr = torch.randn(B, 16, 64, device="cuda", generator=gen).bfloat16()
            o_ref, lse_ref = mla_decode(q, qr, store, bt, n_paged, scale)
            if B == 32:
                base = (q, qr, store, bt, n_paged, scale)
                rows.append((scheme, "library default (mla_decode)", bench(lambda b=base: mla_decode(*b)), 0.0))
            for name, warps, stages, maxnreg in VARIANTS:
                if args.only and name not in args.only.split(","):
                    continue
                if name == "gluon":  # GPU only: Gluon has no CPU interpreter
                    from decode_gluon import _gluon_sliced_kernel as kern

                    content = sliced
                elif name == "wgmma":  # GPU only, the library's packing
                    from decode_wgmma import _wgmma_lowbit_kernel as kern

                    content = store.content
                else:
                    kern, content = (_lowbit_kernel, store.content) if name == "lib" else (_sliced_kernel, sliced)
                for per_sm in args.per_sm:
                    ns = splits_for(per_sm, B, 16, bt.shape[1])
                    a = (kern, q, qr, store, content, bt, n_paged, scale, ns, warps, stages, maxnreg)
                    o, lse = launch(*a)
                    err = float((o.float() - o_ref.float()).norm() / o_ref.float().norm())
                    if err > 1e-3 or float((lse - lse_ref).abs().max()) > 1e-3:
                        raise RuntimeError(f"{name} {warps}/{stages}/{maxnreg} disagrees with mla_decode: {err:.3g}")
                    if B == 32:
                        label = f"{name} warps={warps} stages={stages} maxnreg={maxnreg} per_sm={per_sm:g}"
                        rows.append((scheme, label, bench(lambda a=a: launch(*a)), err))
            del store, sliced
            torch.cuda.empty_cache()
    print(f"copy bandwidth {res['copy_gbs']:.0f} GB/s; h=16, B=32, 64K; do_bench median, L2 flushed\n")
    print("| scheme | variant | us | vs library default | rel. err vs library |\n|---|---|---|---|---|")
    base = {}
    for scheme, label, us, err in rows:
        base.setdefault(scheme, us)
        print(f"| {scheme} | {label} | {us:.1f} | {base[scheme] / us:.2f}x | {err:.1e} |")
    res["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
