"""The fused cache write: quantise, pack and store new tokens into field-major record pages, one
program per token (Triton; the CPU interpreter runs it in tests).

It computes exactly :meth:`quantmla.formats.records.RecordLayout.write_pages` (bit for bit: the
minimum rounded down and the scale rounded up to fp16 from float64, IEEE division, round half to even)
in one launch instead of the torch path's few dozen small kernels, which dominate an engine's decode
step at 27 layers. Covers the kernel schemes (``bf16``, ``c4r4``, ``c2r4``); padding slots (``< 0``)
are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla.formats.packing import CONTENT_PLANES, ROPE_PLANES
from quantmla.formats.records import RecordLayout
from quantmla.formats.windows import SUB


@triton.jit
def _fp16_down(lo):
    """The largest fp16 <= ``lo`` (fp32), as fp16."""
    h = lo.to(tl.float16)
    hb = h.to(tl.int16, bitcast=True)
    hf = h.to(tl.float32)
    down = tl.where(hf > 0, hb - 1, tl.where(hf < 0, hb + 1, -32767))  # -32767: 0x8001, the least negative
    return tl.where(hf > lo, down.to(tl.int16), hb).to(tl.float16, bitcast=True)


@triton.jit
def _fp16_up(v):
    """The least fp16 >= ``v`` (float64, ``v >= 0``), as fp16."""
    h = v.to(tl.float32).to(tl.float16)
    hb = h.to(tl.int16, bitcast=True)
    return tl.where(h.to(tl.float64) < v, hb + 1, hb).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def bf16_bits(x):
    """The bits of ``x`` (fp32, finite) rounded half to even to bfloat16, as int16 (integer arithmetic: the
    same on the GPU and in the interpreter, whose float cast truncates)."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _quantize(x, BITS: tl.constexpr):
    """Codes (int32), scale and minimum (fp16) of ``x [groups, group]`` (fp32), as ``quantize_groups``."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    mn = _fp16_down(tl.min(x, 1))
    mn = tl.maximum(mn.to(tl.float32), -65504.0).to(tl.float16)
    sc = _fp16_up((tl.max(x, 1).to(tl.float64) - mn.to(tl.float64)) / QMAX)
    s = sc.to(tl.float32)[:, None]
    safe = tl.where(s > 0, s, 1.0)
    v = tl.math.div_rn(x - mn.to(tl.float32)[:, None], safe)
    code = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds 0 <= v < 2**22 half to even in fp32
    code = tl.minimum(tl.maximum(code, 0.0), QMAX)
    code = tl.where(s > 0, code, 0.0)
    return code.to(tl.int32), sc, mn


@triton.jit
def _pack(code, BITS: tl.constexpr, PLANES: tl.constexpr, D: tl.constexpr):
    """Group-planar words ``[D / PLANES]`` (int64) of codes ``[groups, group]`` (``pack_words``)."""
    planes = tl.reshape(code, [PLANES, D // PLANES]).to(tl.int64)
    shift = (tl.arange(0, PLANES) * BITS).to(tl.int64)[:, None]
    return tl.sum(planes << shift, axis=0)


@triton.jit
def _write_kernel(
    C, R, SLOTS, P32, P16, PH, stride_c, stride_r, SROWS, SMAP,
    DC: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, CB: tl.constexpr, RB: tl.constexpr,
    BS: tl.constexpr, REC: tl.constexpr, CC: tl.constexpr, CSM: tl.constexpr, RC: tl.constexpr,
    RSM: tl.constexpr, QUANT: tl.constexpr, SHADOW: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    slot = tl.load(SLOTS + i)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        page = blk * (BS * REC)  # the page's first byte
        c = tl.load(C + i * stride_c + tl.arange(0, DC)).to(tl.float32)
        r = tl.load(R + i * stride_r + tl.arange(0, DR)).to(tl.float32)
        if QUANT:
            cc, csc, cmn = _quantize(tl.reshape(c, [DC // G, G]), CB)
            rc, rsc, rmn = _quantize(tl.reshape(r, [DR // G, G]), RB)
            cw = _pack(cc, CB, 8, DC)
            rw = _pack(rc, RB, 4, DR)
            if CB == 4:  # 32-bit words
                tl.store(P32 + (page + BS * CC + off * (DC // 2)) // 4 + tl.arange(0, DC // 8), cw.to(tl.int32))
            else:  # 16-bit words
                tl.store(P16 + (page + BS * CC + off * (DC // 4)) // 2 + tl.arange(0, DC // 8), cw.to(tl.int16))
            tl.store(P16 + (page + BS * RC + off * (DR // 2)) // 2 + tl.arange(0, DR // 4), rw.to(tl.int16))
            ng: tl.constexpr = DC // G
            csm = PH + (page + BS * CSM + off * (4 * ng)) // 2 + 2 * tl.arange(0, ng)
            tl.store(csm, csc)
            tl.store(csm + 1, cmn)
            ngr: tl.constexpr = DR // G
            rsm = PH + (page + BS * RSM + off * (4 * ngr)) // 2 + 2 * tl.arange(0, ngr)
            tl.store(rsm, rsc)
            tl.store(rsm + 1, rmn)
            if SHADOW:  # the token in BF16 into its shadow row, if its sub-page has one
                sh = tl.load(SMAP + slot // SUB).to(tl.int64)
                if sh >= 0:
                    srow = SROWS + (sh * SUB + slot % SUB) * (DC + DR)
                    tl.store(srow + tl.arange(0, DC), bf16_bits(c))
                    tl.store(srow + DC + tl.arange(0, DR), bf16_bits(r))
        else:  # one BF16 field [c | k^R] a token
            row = P16 + (page + off * (2 * (DC + DR))) // 2  # the one field [c | k^R], field-major in the page
            tl.store(row + tl.arange(0, DC), bf16_bits(c))
            tl.store(row + DC + tl.arange(0, DR), bf16_bits(r))


def fused_scheme(layout: RecordLayout) -> bool:
    """Whether the fused write and read (:mod:`quantmla.kernels.gather`) cover the layout's scheme: ``bf16``
    or 2/4-bit integer content with a 4-bit integer RoPE key (``c4r4``, ``c2r4``)."""
    s = layout.cache_scheme
    return "bf16" in layout.fields or (
        s.content.bits in (2, 4) and s.rope.bits == 4 and s.content.kind == s.rope.kind == "int"
    )


def field_offsets(layout: RecordLayout) -> dict[str, int]:
    """Byte offset of each field the fused kernels address within a record (0 where the scheme has none)."""
    f = layout.fields
    return {k: f[k][0] if k in f else 0 for k in ("c_codes", "c_sm", "r_codes", "r_sm")}


def write_records(
    layout: RecordLayout,
    pages: torch.Tensor,
    slots: torch.Tensor,
    c: torch.Tensor,
    r: torch.Tensor,
    shadow_rows: torch.Tensor | None = None,
    shadow_map: torch.Tensor | None = None,
    sub: int = SUB,
):
    """:meth:`RecordLayout.write_pages` in one launch for ``bf16``, ``c4r4`` and ``c2r4``: tokens
    ``c [N, d_c]``, ``r [N, d_r]`` (rows may be strided) into field-major ``pages`` at ``slots [N]``
    (``< 0``: skipped). With ``shadow_rows`` (bf16 ``[rows, d_c + d_r]``) and ``shadow_map`` (int32, a
    slot's sub-page ``slot // sub`` to its shadow sub-page or -1), a quantised scheme's tokens also go
    to their shadow rows in BF16 (:meth:`quantmla.serving.windows.ShadowRows.write`)."""
    s = layout.cache_scheme
    quant = "bf16" not in layout.fields
    if not fused_scheme(layout):
        raise ValueError(f"scheme {layout.scheme!r} has no fused write; valid: bf16, c4r4, c2r4")
    if pages.dtype != torch.uint8 or pages.dim() != 3 or not pages.is_contiguous():
        raise ValueError("pages must be contiguous uint8 [num_blocks, block_size, record_bytes]")
    n = c.shape[0]
    if n == 0:
        return
    if c.stride(-1) != 1 or r.stride(-1) != 1:
        c, r = c.contiguous(), r.contiguous()
    off = field_offsets(layout)
    if quant and (layout.kv_lora_rank % CONTENT_PLANES or layout.rope_dim % ROPE_PLANES):
        raise ValueError("the fused write needs d_c divisible by 8 and d_r by 4")
    shadow = shadow_rows is not None
    if shadow and (shadow_map is None or not quant or shadow_rows.dtype != torch.bfloat16
                   or shadow_map.dtype != torch.int32 or not shadow_rows.is_contiguous()):  # fmt: skip
        raise ValueError("shadow rows (contiguous bfloat16) need an int32 map and a quantised scheme")
    _write_kernel[(n,)](
        c, r, slots, pages.view(torch.int32), pages.view(torch.int16), pages.view(torch.float16),
        c.stride(0), r.stride(0), shadow_rows.view(torch.int16) if shadow else slots,
        shadow_map if shadow else slots,
        DC=layout.kv_lora_rank, DR=layout.rope_dim, G=layout.group_size,
        CB=s.content.bits if quant else 16, RB=s.rope.bits if quant else 16,
        BS=pages.shape[1], REC=layout.record_bytes, CC=off["c_codes"], CSM=off["c_sm"], RC=off["r_codes"],
        RSM=off["r_sm"], QUANT=quant, SHADOW=shadow, SUB=sub, num_warps=4,
    )  # fmt: skip
