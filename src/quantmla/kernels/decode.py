"""MLA decode attention in Triton over a paged latent cache: BF16 and fused low-bit (INT4/INT2 content,
INT4 RoPE key).

One query token per sequence. The query is absorbed: ``q_lat = q_nope @ W_UK`` (``[B, H, d_c]``)
and ``q_pe`` (``[B, H, d_r]``); the kernel returns ``o_lat = softmax(s) @ c`` (``[B, H, d_c]``,
before ``W_UV``) and the log-sum-exp of the scaled scores, like FlashMLA.

Work split (split-KV): program ``(b, split, head_group)`` walks a contiguous range of sequence
``b``'s pages, with every query head of the group sharing each loaded KV tile, so a tile is read
and dequantised once per head group (once per sequence for h <= 64). The unquantised tokens of a
sequence (sinks and the recent window) form one more split: either a small BF16 buffer, read by a
second launch (:func:`_window_kernel`), or BF16 shadow rows read in place through a slot map
(:class:`ShadowWindow`, an engine's low-bit pages), by more programs of the same launch (several at small
batches, :func:`default_window_splits`), each a split of its own. A combine pass
merges the splits by log-sum-exp. How many pages a split reads is planned on the device from the lengths
(:mod:`quantmla.kernels.splits`), so that a CUDA graph's batch, padded with empty sequences, splits as its real
one; the grid holds :func:`~quantmla.kernels.splits.split_capacity` splits a sequence.

This module holds the BF16 paged kernel, the window kernel, the combine pass and the launcher
:func:`mla_decode`; the fused low-bit kernel is :mod:`quantmla.kernels.decode_lowbit`.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantmla.formats.windows import SUB
from quantmla.kernels.layout import PagedLatentStore, PagedLayout
from quantmla.kernels.splits import (
    MAX_SPLITS,
    PLAN_BLOCK,
    paged_tokens,
    plan_pages_per_split,
    sm_count,
    split_capacity,
    split_pages,
)


@triton.jit
def online_softmax(qk, smask, m_i, l_i, scale_log2, SAFE: tl.constexpr):
    """One tile's scores ``qk [rows, T]`` masked by ``smask`` (``[1, T]`` or ``[rows, T]``) into the running
    max and sum: ``(m_new, l_i, alpha, p)``. ``SAFE``: a row may have no token in the tile (per-row masks of
    several query tokens), so a row still at -inf keeps alpha and p at 0 instead of NaN."""
    qk = tl.where(smask, qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, alpha, p


@triton.jit
def _attend(
    q0, q1, q2, q3, qr0, qr1, c0, c1, c2, c3, r0, r1, smask, m_i, l_i, a0, a1, a2, a3, scale_log2, DT: tl.constexpr,
    SAFE: tl.constexpr,
):  # fmt: skip
    # DT is bfloat16 on the GPU; float32 under the CPU interpreter, whose bf16 dot is not numeric and
    # whose bf16 casts truncate
    c0, c1, c2, c3, r0, r1 = c0.to(DT), c1.to(DT), c2.to(DT), c3.to(DT), r0.to(DT), r1.to(DT)
    qk = tl.dot(q0.to(DT), tl.trans(c0))
    qk += tl.dot(q1.to(DT), tl.trans(c1))
    qk += tl.dot(q2.to(DT), tl.trans(c2))
    qk += tl.dot(q3.to(DT), tl.trans(c3))
    qk += tl.dot(qr0.to(DT), tl.trans(r0))
    qk += tl.dot(qr1.to(DT), tl.trans(r1))
    m_new, l_i, alpha, p = online_softmax(qk, smask, m_i, l_i, scale_log2, SAFE)
    pb = p.to(DT)
    a0 = a0 * alpha[:, None] + tl.dot(pb, c0)
    a1 = a1 * alpha[:, None] + tl.dot(pb, c1)
    a2 = a2 * alpha[:, None] + tl.dot(pb, c2)
    a3 = a3 * alpha[:, None] + tl.dot(pb, c3)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def query_rows(hg, H, QT: tl.constexpr, BLOCK_H: tl.constexpr):
    """A program's query rows: ``QT`` query tokens of ``H`` heads each, row ``t * H + h``. Returns the rows,
    their mask, and how many of the sequence's tokens come after each row's token (``QT - 1 - t``)."""
    rows = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    return rows, rows < QT * H, QT - 1 - rows // H


@triton.jit
def page_score_mask(tmask, pos, total, back, WS: tl.constexpr, WR: tl.constexpr, QT: tl.constexpr):
    """The score mask of a page tile (positions ``pos [T]``, tile mask ``tmask``): ``[1, T]`` for one query
    token; with several, row ``r`` (``back[r]`` tokens after it) also only up to its own paged tokens, those
    of a sequence of ``total - back[r]`` (causal among the query tokens, and each row's own window)."""
    if QT == 1:  # (a constexpr branch: one return type per specialisation)
        m = tmask[None, :]
    else:
        m = tmask[None, :] & (pos[None, :] < paged_tokens(total - back, WS, WR)[:, None])
    return m


@triton.jit
def window_score_mask(tmask, pos, total, back, WS: tl.constexpr, WR: tl.constexpr, QT: tl.constexpr):
    """The score mask of a tile of shadow window rows (positions ``pos``): with several query tokens, row
    ``r`` sees the sinks and its own last ``WR`` tokens of its ``total - back[r]``."""
    if QT == 1:
        m = tmask[None, :]
    else:
        n_r = (total - back)[:, None]
        m = tmask[None, :] & (pos[None, :] < n_r) & ((pos[None, :] < WS) | (pos[None, :] >= n_r - WR))
    return m


@triton.jit
def _load_bf16_rows(row_ptr, tmask, DC: tl.constexpr, PL: tl.constexpr, RPL: tl.constexpr):
    """Planes of BF16 token rows ``[c | k^R]`` (``row_ptr``: one pointer per token)."""
    cp = tl.arange(0, PL)[None, :]
    rp = tl.arange(0, RPL)[None, :]
    msk = tmask[:, None]
    c0 = tl.load(row_ptr[:, None] + cp, mask=msk, other=0.0)
    c1 = tl.load(row_ptr[:, None] + PL + cp, mask=msk, other=0.0)
    c2 = tl.load(row_ptr[:, None] + 2 * PL + cp, mask=msk, other=0.0)
    c3 = tl.load(row_ptr[:, None] + 3 * PL + cp, mask=msk, other=0.0)
    r0 = tl.load(row_ptr[:, None] + DC + rp, mask=msk, other=0.0)
    r1 = tl.load(row_ptr[:, None] + DC + RPL + rp, mask=msk, other=0.0)
    return c0, c1, c2, c3, r0, r1


@triton.jit
def _store_partial(OP, LP, b, split, heads, hmask, H, NS, m_i, l_i, a0, a1, a2, a3, PL: tl.constexpr, active):
    """A split's log-sum-exp (-inf when it attended nothing) and, for a split with tokens (``active``), its
    normalised output; the combine pass reads no output behind a -inf."""
    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LP + (b * NS + split) * H + heads, lse, mask=hmask)
    obase = OP + ((b * NS + split) * H + heads)[:, None] * (4 * PL) + tl.arange(0, PL)[None, :]
    msk = tl.where(active, hmask, False)[:, None]
    tl.store(obase, a0 * inv[:, None], mask=msk)
    tl.store(obase + PL, a1 * inv[:, None], mask=msk)
    tl.store(obase + 2 * PL, a2 * inv[:, None], mask=msk)
    tl.store(obase + 3 * PL, a3 * inv[:, None], mask=msk)


@triton.jit
def init_state(BLOCK_H: tl.constexpr, PL: tl.constexpr):
    """Online-softmax state: running max, running sum and the four output-plane accumulators."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    a0 = tl.zeros([BLOCK_H, PL], tl.float32)
    a1 = tl.zeros([BLOCK_H, PL], tl.float32)
    a2 = tl.zeros([BLOCK_H, PL], tl.float32)
    a3 = tl.zeros([BLOCK_H, PL], tl.float32)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def query_offsets(SQB, SQT, SQH, b, rows, H):
    """Element offsets of sequence ``b``'s query rows (row ``t * H + h``: strides ``SQB, SQT, SQH`` per
    sequence, query token and head)."""
    return b * SQB + (rows // H) * SQT + (rows % H) * SQH


@triton.jit
def _load_query(Q, QR, SQB, SQT, SQH, SRB, SRT, SRH, b, rows, H, hmask, PL: tl.constexpr, RPL: tl.constexpr):
    """Sequence ``b``'s query rows, four content planes and two RoPE planes, channels contiguous."""
    qb = Q + query_offsets(SQB, SQT, SQH, b, rows, H)[:, None] + tl.arange(0, PL)[None, :]
    msk = hmask[:, None]
    q0 = tl.load(qb, mask=msk, other=0.0)
    q1 = tl.load(qb + PL, mask=msk, other=0.0)
    q2 = tl.load(qb + 2 * PL, mask=msk, other=0.0)
    q3 = tl.load(qb + 3 * PL, mask=msk, other=0.0)
    qrb = QR + query_offsets(SRB, SRT, SRH, b, rows, H)[:, None] + tl.arange(0, RPL)[None, :]
    qr0 = tl.load(qrb, mask=msk, other=0.0)
    qr1 = tl.load(qrb + RPL, mask=msk, other=0.0)
    return q0, q1, q2, q3, qr0, qr1


@triton.jit
def shadow_row_pointers(ROWS, MAP, BT, b, MAXP, n, t0, TRASH, PAGE: tl.constexpr, SUB: tl.constexpr, WS: tl.constexpr,
                 WR: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Row pointers, mask and token positions of window positions ``[t0, t0 + BLOCK_T)`` of sequence ``b``
    (``n`` tokens) in its shadow rows: window position ``k`` is token ``k`` (a sink, or every token when
    ``n <= WS + WR``) or ``n - WS - WR + k``; its slot's sub-page (``slot // SUB``) maps to a shadow sub-page
    through ``MAP`` (none: the scratch row ``TRASH``)."""
    W: tl.constexpr = WS + WR
    k = t0 + tl.arange(0, BLOCK_T)
    tmask = k < tl.minimum(n, W)
    pos = tl.where((n > W) & (k >= WS), n - W + k, k)
    pos = tl.where(tmask, pos, 0)
    blk = tl.load(BT + b * MAXP + pos // PAGE, mask=tmask, other=0).to(tl.int64)
    slot = blk * PAGE + pos % PAGE
    sh = tl.load(MAP + slot // SUB, mask=tmask, other=-1).to(tl.int64)
    row = tl.where(sh >= 0, sh * SUB + slot % SUB, TRASH)
    return ROWS + row * D, tmask, pos


@triton.jit(do_not_specialize=["NS", "NSP"])
def _paged_kernel(
    Q, QR, SQB, SQT, SQH, SRB, SRT, SRH, KV, KV_PS, BT, NPAGED, KSTART, OP, LP, NUSED, H, MAXP, NS, NSP, scale_log2,
    DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    DT: tl.constexpr, PLAN: tl.constexpr, SMS: tl.constexpr, MAXS: tl.constexpr, PLAN_B: tl.constexpr,
    QT: tl.constexpr,
):  # fmt: skip
    """BF16 pages ``[c | k^R]`` (FlashMLA's dense layout); ``KV_PS``: elements from one page to the next. The
    first split of each sequence stores how many splits have tokens in ``NUSED``. ``QT`` query tokens a
    sequence (its last ``QT``, causal among them): ``QT * H`` query rows."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    hg = tl.program_id(2)
    PL: tl.constexpr = DC // 4
    RPL: tl.constexpr = DR // 2
    rows, hmask, back = query_rows(hg, H, QT, BLOCK_H)
    per = 0
    if PLAN:
        per = plan_pages_per_split(NPAGED, tl.num_programs(0), tl.num_programs(2), NS, PAGE, 0, 0, SMS, MAXS, PLAN_B)
    n, kstart, p0, p1, used = split_pages(NPAGED, KSTART, b, split, NS, per, PAGE, 0, 0, PLAN)
    active = p0 < p1
    tl.store(NUSED + b, used, mask=(split == 0) & (hg == 0))  # the combine reads this many
    q0, q1, q2, q3, qr0, qr1 = _load_query(
        Q, QR, SQB, SQT, SQH, SRB, SRT, SRH, b, rows, H, tl.where(active, hmask, False), PL, RPL
    )
    m_i, l_i, a0, a1, a2, a3 = init_state(BLOCK_H, PL)
    for p in range(p0, p1):
        page = tl.load(BT + b * MAXP + p).to(tl.int64)
        for t0 in tl.static_range(0, PAGE, BLOCK_T):
            toks = t0 + tl.arange(0, BLOCK_T)
            pos = p * PAGE + toks
            tmask = (pos < n) & (pos >= kstart)
            row = page * KV_PS + toks * (DC + DR)  # the token's first element
            c0, c1, c2, c3, r0, r1 = _load_bf16_rows(KV + row, tmask, DC, PL, RPL)
            smask = page_score_mask(tmask, pos, n, back, 0, 0, QT)
            m_i, l_i, a0, a1, a2, a3 = _attend(
                q0, q1, q2, q3, qr0, qr1, c0, c1, c2, c3, r0, r1, smask, m_i, l_i, a0, a1, a2, a3, scale_log2, DT,
                QT > 1,
            )  # fmt: skip
    _store_partial(OP, LP, b, split, rows, hmask, QT * H, NSP, m_i, l_i, a0, a1, a2, a3, PL, active)


@triton.jit
def _window_kernel(
    Q,
    QR,
    SQB,
    SQH,
    SRB,
    SRH,
    HP,
    HPLEN,
    WSKIP,
    OP,
    LP,
    H,
    HPCAP,
    NS,
    scale_log2,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DT: tl.constexpr,
):
    """The unquantised tokens of each sequence (sinks + recent window): split index ``NS``."""
    b = tl.program_id(0)
    hg = tl.program_id(2)
    PL: tl.constexpr = DC // 4
    RPL: tl.constexpr = DR // 2
    heads, hmask, _ = query_rows(hg, H, 1, BLOCK_H)
    q0, q1, q2, q3, qr0, qr1 = _load_query(Q, QR, SQB, 0, SQH, SRB, 0, SRH, b, heads, H, hmask, PL, RPL)
    m_i, l_i, a0, a1, a2, a3 = init_state(BLOCK_H, PL)
    hl = tl.load(HPLEN + b)
    wskip = tl.load(WSKIP + b)  # window rows before this index are masked (left padding in the sinks)
    for t0 in range(0, hl, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = (rows < hl) & (rows >= wskip)
        c0, c1, c2, c3, r0, r1 = _load_bf16_rows(HP + (b * HPCAP + rows).to(tl.int64) * (DC + DR), tmask, DC, PL, RPL)
        m_i, l_i, a0, a1, a2, a3 = _attend(
            q0, q1, q2, q3, qr0, qr1, c0, c1, c2, c3, r0, r1, tmask[None, :], m_i, l_i, a0, a1, a2, a3, scale_log2,
            DT, False,
        )  # fmt: skip
    _store_partial(OP, LP, b, NS, heads, hmask, H, NS + 1, m_i, l_i, a0, a1, a2, a3, PL, hl > 0)


@dataclass(frozen=True)
class ShadowWindow:
    """Each sequence's first ``sink`` and last ``recent`` tokens in BF16 shadow rows, read in place by
    :func:`mla_decode`: ``rows [N + 1, d_c + d_r]`` (bf16; the last, scratch) and ``map`` (int32 ``[slots /
    sub]``: a slot's sub-page ``slot // sub`` to its shadow sub-page, -1 for none), as
    :class:`quantmla.serving.windows.WindowPool` keeps them."""

    rows: torch.Tensor
    map: torch.Tensor
    sink: int
    recent: int
    sub: int = SUB

    def __post_init__(self) -> None:
        if self.rows.dtype != torch.bfloat16 or self.rows.dim() != 2 or not self.rows.is_contiguous():
            raise ValueError(f"shadow rows must be contiguous bfloat16 [N + 1, d], got {self.rows.dtype}")
        if self.map.dtype != torch.int32 or self.sink < 0 or self.recent < 0 or self.sink + self.recent == 0:
            raise ValueError("the shadow map must be int32 and sink + recent > 0")


@triton.jit(do_not_specialize=["NSP"])
def _combine_kernel(OP, LP, OUT, LSE, NUSED, H, NSP, DC: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                    USED: tl.constexpr, WIN: tl.constexpr):  # fmt: skip
    """Merge the split partials of one (sequence, head) by log-sum-exp, for channels
    ``[BLOCK_D * program_id(2), +BLOCK_D)`` (so that small batches still fill the GPU), ``CHUNK`` splits
    at a time with a running maximum; a split whose log-sum-exp is -inf attended nothing and its output
    is not read (empty splits do not write one). With ``USED`` it reads only the sequence's first
    ``NUSED[b]`` splits (those with tokens; a CUDA graph's grid holds more) and the last ``WIN`` (``NSP - WIN``
    on: the windows'); else all ``NSP``."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    if USED:
        nused = tl.load(NUSED + b)
    else:
        nused = NSP - WIN
    cnt = nused + WIN
    mx = tl.full((), float("-inf"), tl.float32)
    tot = tl.zeros((), tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, cnt, CHUNK):
        cidx = s0 + tl.arange(0, CHUNK)
        slot = tl.where(cidx < nused, cidx, NSP - WIN + cidx - nused)  # past the used splits: the windows'
        lse = tl.load(LP + (b * NSP + slot) * H + h, mask=cidx < cnt, other=float("-inf"))
        m_new = tl.maximum(mx, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep = tl.exp(mx - m_safe)  # 0 while nothing was attended
        w = tl.exp(lse - m_safe)
        full = lse > float("-inf")
        o = tl.load(OP + ((b * NSP + slot)[:, None] * H + h) * DC + d[None, :], mask=full[:, None], other=0.0)
        acc = acc * keep + tl.sum(w[:, None] * o, 0)
        tot = tot * keep + tl.sum(w, 0)
        mx = m_new
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    out = acc / tl.where(tot > 0, tot, 1.0)
    tl.store(OUT + (b * H + h) * DC + d, out.to(OUT.dtype.element_ty))
    if tl.program_id(2) == 0:
        tl.store(LSE + b * H + h, tl.where(tot > 0, m_safe + tl.log(tl.where(tot > 0, tot, 1.0)), float("-inf")))


#: window rows per tile of the low-bit kernel's window program: its registers come on top of the page
#: loop's (the kernel's 255 at 16 heads); ptxas for sm_90 spills 160 bytes at 16, 1356 at 64
WINDOW_BLOCK_T = 16
COMBINE_BLOCK_D = 64  # channels per combine program: B * H * DC / 64 programs
COMBINE_CHUNK = 32  # splits per combine step: fewer dependent steps (docs/notebook.md, "used splits"); a warp per 32
PARTIAL_DTYPES = (torch.float32, torch.float16)  # the split partials' dtypes :func:`mla_decode` takes
logger = logging.getLogger(__name__)
NUM_WARPS = (4, 8)  # the launches tested (16 warps faulted at 128 heads on H100: decode_attention.py --sweep)


@functools.lru_cache(maxsize=64)
def _zeros_i32(n: int, device: torch.device) -> torch.Tensor:
    """A read-only int32 zero vector, kept between calls (one fill kernel and allocation fewer per call)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def window_programs(rows: int, splits: int) -> tuple[int, int]:
    """The window programs a (sequence, head group) runs to read ``rows`` window positions over about
    ``splits`` programs, and the positions each reads (whole ``WINDOW_BLOCK_T`` tiles): ``(0, 0)`` without
    windows."""
    if rows == 0:
        return 0, 0
    if splits < 1:
        raise ValueError(f"window_splits={splits}: must be at least 1")
    per = triton.cdiv(triton.cdiv(rows, splits), WINDOW_BLOCK_T) * WINDOW_BLOCK_T
    return triton.cdiv(rows, per), per


def default_window_splits(seq_groups: int, rows: int) -> int:
    """Window programs a (sequence, head group) for a launch of ``seq_groups`` (sequences x head groups) and
    ``rows`` window positions. With few sequences the one window program is the launch's longest path (132
    rows in 9 tiles, where a page program reads a 64-token page or two); from 8 on, the page programs fill the
    GPU and more window programs only add partials to write and merge. H200, C4R4, 16 heads, 4 + 128 windows,
    27 layers in a CUDA graph (docs/notebook.md, "the window over several programs"): 1 x 4K 22.4 -> 10.8 us
    a layer at one tile a program; 4 x 4K 28.0 -> 17.5 at three programs; 8 and 48 sequences slowest past
    one. Two sequences (not measured) take the four's figure."""
    if seq_groups <= 1:
        return triton.cdiv(rows, WINDOW_BLOCK_T)
    return 3 if seq_groups <= 4 else 1


def default_launch(block_h: int, content_bits: int) -> dict:
    """Launch parameters tuned on H200 at B=32, 64K (benchmarks/decode_attention.py --sweep; the figures
    are in BENCHMARKS.md). The low-bit kernel at h <= 16 runs two pipeline stages (cp.async of the next
    tile's words and scale words); the 64-head launch keeps one. No register cap (a cap helped INT2 at one
    stage only, and two stages win)."""
    if content_bits != 16:  # the low-bit kernel
        return dict(block_t=64, num_warps=4 if block_h <= 16 else 8, num_stages=2 if block_h <= 16 else 1, maxnreg=None)
    return dict(block_t=64, num_warps=4 if block_h <= 16 else 8, num_stages=3 if block_h <= 16 else 2, maxnreg=None)


KERNELS = ("auto", "sm90", "triton")  # the page kernels :func:`mla_decode` takes


@functools.cache
def _say_once(level: int, message: str) -> None:
    logger.log(level, message)


def _page_backend(kernel: str, layout: PagedLayout, rows: int, device: torch.device, interpret: bool) -> str:
    """The kernel that reads the pages: ``"sm90"`` or ``"triton"`` (see :func:`mla_decode`'s ``kernel``)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; valid: {', '.join(KERNELS)}")
    if kernel == "triton":
        return "triton"
    from quantmla.kernels.hopper import HopperUnavailable, extension, unsupported

    why = unsupported(layout, rows, device, False)
    if why is None and interpret:
        why = "the Triton interpreter (TRITON_INTERPRET=1)"
    toolchain = None
    if why is None:  # this machine's toolchain (checked once a process: extension() is cached, so is missing())
        try:
            extension()
        except HopperUnavailable as e:
            toolchain = str(e)
    if why is None and toolchain is None:
        _say_once(logging.INFO, f"mla_decode: the sm_90a kernel reads {layout.scheme} pages ({rows} query rows)")
        return "sm90"
    if kernel == "sm90":
        raise ValueError(f"kernel='sm90' cannot serve this call: {why or toolchain}")
    if toolchain is not None:
        _say_once(logging.WARNING, f"mla_decode: the sm_90a kernel is not available ({toolchain}); the Triton kernel"
                  f" reads the pages instead (same arithmetic, slower at >= 64 query rows)")  # fmt: skip
    return "triton"


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: PagedLatentStore,
    block_table: torch.Tensor,
    n_paged: torch.Tensor,
    scale: float,
    window: torch.Tensor | None = None,
    window_len: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_t: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    paged_start: torch.Tensor | None = None,
    window_skip: torch.Tensor | None = None,
    shadow: ShadowWindow | None = None,
    min_batch: int | None = None,
    window_splits: int | None = None,
    partial_dtype: torch.dtype = torch.float32,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged (low-bit or BF16) latent cache: one query token a sequence, or ``S`` (a
    speculative-decoding step's verified tokens: the sequence's last ``S``, causal among them).

    Args:
        q_lat: ``[B, H, d_c]`` or ``[B, S, H, d_c]`` bf16, ``q_nope @ W_UK``; q_pe: ``[B, H, d_r]`` or
            ``[B, S, H, d_r]`` bf16, the RoPE'd query. With ``S`` query tokens, ``n_paged`` (or the shadow
            length) counts all of them, and query token ``t`` attends to the first ``n - S + 1 + t`` tokens
            under the exact policy of that length: its own last ``recent`` tokens from the shadows (which must
            hold the ``S - 1`` positions before the step's window too), the rest from the pages. Not with
            ``window``. The outputs then have shape ``[B, S, H, d_c]`` and ``[B, S, H]``.
        store: the page pool; block_table ``[B, max_pages]`` int32; n_paged ``[B]`` int32 tokens in pages.
        scale: softmax scale. window / window_len: ``[B, cap, d_c + d_r]`` bf16 unquantised tokens
            (sinks and recent window) and their count per sequence, joined into the same softmax.
        paged_start / window_skip: ``[B]`` int32; paged tokens before ``paged_start`` and window rows
            before ``window_skip`` are masked out (left padding). Default: nothing masked.
        shadow: the sinks and recent window read in place from shadow rows (:class:`ShadowWindow`);
            ``n_paged`` then holds each sequence's whole length, and the pages are read for
            ``[sink, n - recent)`` only. Not with ``window`` or ``paged_start``.
        num_splits: each sequence's pages in this many splits. ``None``: the kernel plans the splits on
            the device from the lengths (:mod:`quantmla.kernels.splits`: the default count for the sequences
            that have pages, so a CUDA graph's batch padded with empty ones splits as the real batch).
        min_batch: while a CUDA graph is captured, the fewest real sequences it will replay (the rest of its
            ``B`` padded empty; vLLM: one more than the next smaller captured size). The grid holds the most
            splits any batch from there to ``B`` plans (:func:`~quantmla.kernels.splits.split_capacity`);
            ``None`` under capture takes half of ``B``. Ignored outside a capture, where ``B`` is the batch.
        window_splits: with ``shadow``, the programs a (sequence, head group) that read its window rows, each
            a run of ``WINDOW_BLOCK_T``-row tiles; ``None`` takes :func:`default_window_splits`.
        partial_dtype: the dtype of the splits' normalised partial outputs, written by the split programs and
            read by the combine: ``float32``, or ``float16`` with a quantised store (its kernel computes in fp16
            already, so no new range limit), which halves that traffic (at 48 x 4K, written and read back, about
            as many bytes as the records the splits read) and rounds each partial once. Log-sum-exps stay
            float32. (``bfloat16`` partials were tried: their rounding exceeds the kernel's own error.)
        block_t, block_h, num_warps, num_stages, maxnreg: launch parameters of the Triton kernels; ``None`` takes
            :func:`default_launch` (tuned on H200); ``maxnreg=0`` lifts the default register cap.
        kernel: which kernel reads the pages: ``"sm90"`` (:mod:`quantmla.kernels.hopper`: a low-bit store with
            INT4 RoPE in groups of 64 at 512 + 64 channels, at least 64 query rows a sequence, an sm_90 GPU;
            anything else is refused with the reason), ``"triton"``, or ``"auto"`` (the default): ``sm90`` where it
            serves, else Triton, with a one-time warning when only this machine's toolchain stands in the way.
            ``mla_decode.last_backend`` says which ran.
    Returns:
        ``o_lat [B, H, d_c]`` (``out_dtype``) and ``lse [B, H]`` float32 (natural log of the sum of
        exponentiated scaled scores).

    The low-bit kernel (:mod:`quantmla.kernels.decode_lowbit`) computes in fp16 (queries, dequantised
    cache, probabilities) with fp32 accumulation; the BF16 kernel in bf16.
    """
    lay = store.layout
    if q_lat.dim() not in (3, 4) or q_pe.dim() != q_lat.dim():
        raise ValueError(f"queries must be [B, H, d] or [B, S, H, d], got {tuple(q_lat.shape)} and {tuple(q_pe.shape)}")
    multi = q_lat.dim() == 4
    if not multi:
        q_lat, q_pe = q_lat.unsqueeze(1), q_pe.unsqueeze(1)
    B, S, H, DC = q_lat.shape
    DR = q_pe.shape[-1]
    if S < 1:
        raise ValueError(f"{S} query tokens a sequence: must be at least 1")
    if S > 1 and window is not None:
        raise ValueError(f"{S} query tokens a sequence read their windows from shadows (or none), not from window=")
    if (DC, DR) != (lay.kv_lora_rank, lay.rope_dim):
        raise ValueError(f"query dims ({DC}, {DR}) do not match the store ({lay.kv_lora_rank}, {lay.rope_dim})")
    if q_lat.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
        raise ValueError(f"queries must be bfloat16, got {q_lat.dtype} and {q_pe.dtype}")
    if q_pe.shape[:3] != (B, S, H):
        raise ValueError(f"q_pe shape {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)}")
    if block_table.dtype != torch.int32 or n_paged.dtype != torch.int32 or block_table.shape[0] != B:
        raise ValueError("block_table [B, max_pages] and n_paged [B] must be int32")
    if (window is None) != (window_len is None):
        raise ValueError("give window and window_len together")
    if shadow is not None and (window is not None or paged_start is not None or window_skip is not None):
        raise ValueError("shadow windows replace window, paged_start and window_skip: give one or the other")
    if window is not None and (window.dtype != torch.bfloat16 or window.shape[0] != B or window.shape[-1] != DC + DR):
        raise ValueError(f"window must be bfloat16 [B, cap, {DC + DR}], got {window.dtype} {tuple(window.shape)}")
    # read in place with their strides (vLLM hands views: a transposed product and a split), channels contiguous
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    dev = q_lat.device
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()  # no cached graph-pool memory
    if shadow is not None:  # not read with shadows (the kernels take the windows' bounds from the lengths)
        paged_start = window_skip = n_paged
    elif paged_start is None or window_skip is None:
        zeros = torch.zeros(B, dtype=torch.int32, device=dev) if capturing else _zeros_i32(B, dev)
        paged_start = zeros if paged_start is None else paged_start
        window_skip = zeros if window_skip is None else window_skip
    if paged_start.dtype != torch.int32 or window_skip.dtype != torch.int32:
        raise ValueError("paged_start and window_skip must be int32")
    if partial_dtype not in PARTIAL_DTYPES:
        raise ValueError(f"partial_dtype={partial_dtype}: one of {', '.join(map(str, PARTIAL_DTYPES))}")
    if partial_dtype != torch.float32 and not lay.quantized:
        raise ValueError(f"partial_dtype={partial_dtype} needs a quantised store (fp16 range); a BF16 store takes"
                         " torch.float32")  # fmt: skip
    if num_warps is not None and num_warps not in NUM_WARPS:
        raise ValueError(f"num_warps={num_warps}: one of {', '.join(map(str, NUM_WARPS))} (the launches tested)")
    if maxnreg is not None and maxnreg != 0 and not 64 <= maxnreg <= 255:
        raise ValueError(f"maxnreg={maxnreg}: a register cap must be 64..255, 0 (no cap) or None (the default)")
    R = S * H  # query rows a sequence
    backend = _page_backend(kernel, lay, R, dev, interpret=os.environ.get("TRITON_INTERPRET") == "1")
    if backend == "sm90":
        from quantmla.kernels.hopper import query_reason

        why = query_reason(q_lat, q_pe)
        if why is not None and kernel == "sm90":
            raise ValueError(f"kernel='sm90' cannot serve this call: {why}")
        if why is not None:  # the same arithmetic on Triton, which reads any strides
            _say_once(logging.INFO, f"mla_decode: the Triton kernel reads the pages ({why})")
            backend = "triton"
    if block_h is None:
        block_h = min(64, max(16, triton.next_power_of_2(R)))
    hg = triton.cdiv(R, block_h)
    maxp = block_table.shape[1]
    # the grid's splits; the kernels plan how many they use from the lengths on the device, unless given
    plan = num_splits is None
    lo = (min_batch or -(-B // 2)) if capturing else None  # a graph's batch: its tail may be padding
    ns = num_splits or split_capacity(B, hg, maxp, dev, min_batch=lo)
    tuned = default_launch(block_h, lay.content_bits)
    block_t = min(block_t or tuned["block_t"], lay.page_size)
    num_warps = num_warps or tuned["num_warps"]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    stages = {} if interpret else {"num_stages": num_stages or tuned["num_stages"]}
    cap = tuned["maxnreg"] if maxnreg is None else (maxnreg or None)
    paged_regs = {"maxnreg": cap} if cap and not interpret else {}
    ws, wr = (shadow.sink, shadow.recent) if shadow is not None else (0, 0)
    wpos = ws + wr + S - 1 if ws + wr else 0  # window positions read: every query token's own window
    wspl, wrows = window_programs(wpos, window_splits if window_splits is not None
                                  else default_window_splits(B * hg, wpos))  # fmt: skip
    nsp = ns + (1 if window is not None else wspl)
    if shadow is not None and shadow.rows.shape[1] != DC + DR:
        raise ValueError(f"shadow rows are {shadow.rows.shape[1]} wide; the queries need {DC + DR}")
    if shadow is not None and not lay.quantized:
        raise ValueError("a BF16 store holds every token unquantised: shadow windows are for a quantised store")
    # with shadows, ``wspl`` more programs per (sequence, head group) read the window rows: split indices
    # ``0..wspl-1``
    sh = (shadow.rows, shadow.map, shadow.rows.shape[0] - 1) if shadow is not None else (q_lat, block_table, 0)
    sub = shadow.sub if shadow is not None else SUB
    grid = (B, ns + wspl, hg)
    op = torch.empty(B, nsp, R, DC, dtype=partial_dtype, device=dev)
    lp = torch.empty(B, nsp, R, dtype=torch.float32, device=dev)
    scale_log2 = scale * 1.4426950408889634
    # the CPU interpreter's bf16/fp16 dots are not numeric: it computes the dots in fp32
    bf16_dt = tl.float32 if interpret else tl.bfloat16
    used = torch.empty(B, dtype=torch.int32, device=dev)  # page splits with tokens, a sequence (the kernels')
    common = (block_table, n_paged, paged_start, op, lp, used, H, maxp, ns, nsp, scale_log2)
    qs = (q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2))
    planning = dict(PLAN=plan, SMS=sm_count(dev), MAXS=MAX_SPLITS, PLAN_B=PLAN_BLOCK)
    kernel = None
    if backend == "sm90":  # the pages on the Hopper kernel; the window programs (if any) on Triton's
        from quantmla.kernels.hopper import page_splits

        page_splits(q_lat, q_pe, store, block_table, n_paged, paged_start, op, lp, used, ns, ws, wr, plan,
                    sm_count(dev), MAX_SPLITS, scale_log2)  # fmt: skip
    if lay.quantized and (backend == "triton" or wspl):
        from quantmla.kernels.decode_lowbit import lowbit_kernel

        views = store.kernel_views()
        lowbit_grid = grid if backend == "triton" else (B, wspl, hg)  # sm90: only the window programs
        kernel = lowbit_kernel[lowbit_grid](
            q_lat, q_pe, *qs, *views, *(v.stride(0) for v in views), *common, *sh,
            DC=DC, DR=DR, G=lay.group_size, PAGE=lay.page_size, BLOCK_T=block_t, BLOCK_H=block_h,
            CBITS=lay.content_bits, ASM_OK=not interpret, DT=tl.float32 if interpret else tl.float16, WS=ws, WR=wr,
            SUB=sub, WBLOCK_T=WINDOW_BLOCK_T, WSPL=wspl, WROWS=wrows, **planning, QT=S, num_warps=num_warps,
            **stages, **paged_regs,
        )  # fmt: skip
    elif not lay.quantized:
        kernel = _paged_kernel[grid](
            q_lat, q_pe, *qs, store.content, store.content.stride(0), *common,
            DC=DC, DR=DR, PAGE=lay.page_size, BLOCK_T=block_t, BLOCK_H=block_h, DT=bf16_dt, **planning, QT=S,
            num_warps=num_warps, **stages, **paged_regs,
        )  # fmt: skip
    mla_decode.last_kernel = kernel  # the compiled Triton kernel (registers, spills), for benchmarks
    mla_decode.last_backend = backend
    if window is not None:
        window = window.contiguous()
        _window_kernel[(B, 1, hg)](
            q_lat,
            q_pe,
            qs[0],
            qs[2],
            qs[3],
            qs[5],
            window,
            window_len,
            window_skip,
            op,
            lp,
            H,
            window.shape[1],
            ns,
            scale_log2,
            DC=DC,
            DR=DR,
            BLOCK_T=min(64, block_t),
            BLOCK_H=block_h,
            DT=bf16_dt,
            num_warps=num_warps,
            **stages,
        )
    o, lse = combine_splits(op, lp, out_dtype, used=used, window_slots=nsp - ns)
    if multi:
        return o.view(B, S, H, DC), lse.view(B, S, H)
    return o, lse


def combine_splits(op: torch.Tensor, lp: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                   used: torch.Tensor | None = None, window_slots: int = 0):  # fmt: skip
    """Merge split partials ``op [B, S, H, d_c]`` (float32 or a half dtype, each normalised) with their log-sum-exps
    ``lp [B, S, H]`` into ``o [B, H, d_c]`` (``out_dtype``) and ``lse [B, H]``. ``used`` (int32 ``[B]``):
    read only each sequence's first ``used[b]`` splits and the last ``window_slots`` (the windows'); the
    other slots are neither read nor need to be written. Default: all ``S``."""
    B, nsp, H, DC = op.shape
    if not 0 <= window_slots <= nsp:
        raise ValueError(f"window_slots={window_slots}: must be 0..{nsp} (the partials' splits)")
    o = torch.empty(B, H, DC, dtype=out_dtype, device=op.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=op.device)
    bd = min(DC, COMBINE_BLOCK_D)
    _combine_kernel[(B, H, triton.cdiv(DC, bd))](
        op, lp, o, lse, lp if used is None else used, H, nsp, DC=DC, BLOCK_D=bd, CHUNK=COMBINE_CHUNK,
        USED=used is not None, WIN=window_slots, num_warps=max(1, COMBINE_CHUNK // 32),
    )  # fmt: skip
    return o, lse
