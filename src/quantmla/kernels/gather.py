"""The fused cache read: records of any slots of field-major pages back to BF16 rows ``[c | k^R]``, one
program per token (Triton; the CPU interpreter runs it in tests).

It computes exactly :meth:`quantmla.formats.records.RecordLayout.unpack` of
:meth:`~quantmla.formats.records.RecordLayout.read_slots` rounded to BF16 (code times scale, then plus
minimum, in float32 without contraction; round half to even), in one launch instead of the torch path's
dozens of kernels and ``[N, d]`` intermediates. A prefill reading its context (earlier chunks, prefix
hits) through an engine's pages calls it once per layer and chunk. With shadow rows, the tokens the
caller marks (their request's windows) are read from their shadows instead, as
:meth:`quantmla.serving.windows.ShadowRows.lookup`. Covers ``bf16``, ``c4r4`` and ``c2r4``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla.formats.packing import CONTENT_PLANES, ROPE_PLANES
from quantmla.formats.records import RecordLayout
from quantmla.formats.windows import SUB
from quantmla.kernels.write import bf16_bits, field_offsets, fused_scheme


@triton.jit
def _dequant(WORDS, SM, BITS: tl.constexpr, PLANES: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """Float32 values ``[D]`` of one token's group-planar words (channel ``p * D / PLANES + e`` is plane
    ``p`` of word ``e``) and its fp16 (scale, minimum) pairs ``SM`` (one per group of ``G``)."""
    ch = tl.arange(0, D)
    word = tl.load(WORDS + ch % (D // PLANES)).to(tl.int32)
    code = (word >> ((ch // (D // PLANES)) * BITS)) & ((1 << BITS) - 1)
    s = tl.load(SM + 2 * (ch // G)).to(tl.float32)
    m = tl.load(SM + 2 * (ch // G) + 1).to(tl.float32)
    return code.to(tl.float32) * s + m


@triton.jit(do_not_specialize=["TRASH"])  # a row index: one compiled variant for any pool size
def _gather_kernel(
    P32, P16, PH, SLOTS, WANT, SROWS, SMAP, OUT, TRASH,
    DC: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, CB: tl.constexpr, BS: tl.constexpr, REC: tl.constexpr,
    CC: tl.constexpr, CSM: tl.constexpr, RC: tl.constexpr, RSM: tl.constexpr, QUANT: tl.constexpr,
    SHADOW: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + i)
    out = OUT + i * (DC + DR)
    want = 0
    if SHADOW:
        want = tl.load(WANT + i)
    if want != 0:
        sh = tl.load(SMAP + slot // SUB).to(tl.int64)
        row = tl.where(sh >= 0, sh * SUB + slot % SUB, TRASH)
        src = SROWS + row * (DC + DR)
        tl.store(out + tl.arange(0, DC), tl.load(src + tl.arange(0, DC)))
        tl.store(out + DC + tl.arange(0, DR), tl.load(src + DC + tl.arange(0, DR)))
    else:
        blk = slot // BS
        off = slot % BS
        page = blk * (BS * REC)  # the page's first byte
        if QUANT:
            if CB == 4:  # 32-bit content words
                cw = P32 + (page + BS * CC + off * (DC // 2)) // 4
            else:  # 16-bit content words
                cw = P16 + (page + BS * CC + off * (DC // 4)) // 2
            c = _dequant(cw, PH + (page + BS * CSM + off * (4 * (DC // G))) // 2, CB, 8, DC, G)
            rw = P16 + (page + BS * RC + off * (DR // 2)) // 2
            r = _dequant(rw, PH + (page + BS * RSM + off * (4 * (DR // G))) // 2, 4, 4, DR, G)
            tl.store(out + tl.arange(0, DC), bf16_bits(c))
            tl.store(out + DC + tl.arange(0, DR), bf16_bits(r))
        else:  # one BF16 field [c | k^R] a token
            # the one field [c | k^R], field-major in the page; not `row`: Triton types a name once across branches
            rec = P16 + (page + off * (2 * (DC + DR))) // 2
            tl.store(out + tl.arange(0, DC), tl.load(rec + tl.arange(0, DC)))
            tl.store(out + DC + tl.arange(0, DR), tl.load(rec + DC + tl.arange(0, DR)))


def has_fused_gather(layout: RecordLayout) -> bool:
    """Whether :func:`gather_rows` covers the layout's scheme (``bf16``, ``c4r4``, ``c2r4``)."""
    if "bf16" in layout.fields:
        return True
    return fused_scheme(layout) and layout.kv_lora_rank % CONTENT_PLANES == 0 and layout.rope_dim % ROPE_PLANES == 0


def gather_rows(
    layout: RecordLayout,
    pages: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    wanted: torch.Tensor | None = None,
    shadow_rows: torch.Tensor | None = None,
    shadow_map: torch.Tensor | None = None,
    sub: int = SUB,
) -> None:
    """``out[i] = [c | k^R]`` (bf16 ``[N, d_c + d_r]``, contiguous) of the record at ``slots[i]`` of
    field-major ``pages``, or, where ``wanted[i]`` (bool ``[N]``), of its shadow row (``shadow_rows``,
    bf16; ``shadow_map``, int32: a slot's sub-page ``slot // sub`` to its shadow sub-page or -1, then the
    scratch row, the last)."""
    if not has_fused_gather(layout):
        raise ValueError(f"scheme {layout.scheme!r} has no fused gather; valid: bf16, c4r4, c2r4")
    if pages.dtype != torch.uint8 or pages.dim() != 3 or not pages.is_contiguous():
        raise ValueError("pages must be contiguous uint8 [num_blocks, block_size, record_bytes]")
    d = layout.kv_lora_rank + layout.rope_dim
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (slots.shape[0], d):
        raise ValueError(f"out must be contiguous bfloat16 [{slots.shape[0]}, {d}], got {out.dtype} {tuple(out.shape)}")
    shadow = shadow_rows is not None
    if shadow and (wanted is None or shadow_map is None or shadow_rows.dtype != torch.bfloat16
                   or shadow_map.dtype != torch.int32 or not shadow_rows.is_contiguous()):  # fmt: skip
        raise ValueError("shadow rows (contiguous bfloat16) need the wanted mask and an int32 map")
    n = slots.shape[0]
    if n == 0:
        return
    s = layout.cache_scheme
    quant = "bf16" not in layout.fields
    off = field_offsets(layout)
    slots = slots.long().contiguous()
    _gather_kernel[(n,)](
        pages.view(torch.int32), pages.view(torch.int16), pages.view(torch.float16), slots,
        wanted.to(torch.int8) if shadow else slots, shadow_rows.view(torch.int16) if shadow else slots,
        shadow_map if shadow else slots, out.view(torch.int16), shadow_rows.shape[0] - 1 if shadow else 0,
        DC=layout.kv_lora_rank, DR=layout.rope_dim, G=layout.group_size, CB=s.content.bits if quant else 16,
        BS=pages.shape[1], REC=layout.record_bytes, CC=off["c_codes"], CSM=off["c_sm"], RC=off["r_codes"],
        RSM=off["r_sm"], QUANT=quant, SHADOW=shadow, SUB=sub, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip


def warm_gather(layout: RecordLayout, block_size: int, windows: bool, device) -> None:
    """Compile the fused gather for ``layout`` pages of ``block_size`` tokens (with shadow windows or not)
    by gathering one row of a throwaway page: an engine calls it at start so that its first chunked prefill
    does not wait for Triton's compiler (the variant depends only on these and on 16-byte aligned buffers)."""
    d = layout.kv_lora_rank + layout.rope_dim
    pages = torch.zeros(1, block_size, layout.record_bytes, dtype=torch.uint8, device=device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    out = torch.empty(1, d, dtype=torch.bfloat16, device=device)
    shadow = {}
    if windows:
        shadow = dict(wanted=torch.zeros(1, dtype=torch.bool, device=device),
                      shadow_rows=torch.zeros(2, d, dtype=torch.bfloat16, device=device),
                      shadow_map=torch.full((1,), -1, dtype=torch.int32, device=device))  # fmt: skip
    gather_rows(layout, pages, slots, out, **shadow)
