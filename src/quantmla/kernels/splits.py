"""How the decode kernels split each sequence's pages among programs (split-KV), on the host and on the device.

The launch's grid holds :func:`split_capacity` split programs a sequence. Inside the kernels every program
plans the same figure from the lengths (:func:`plan_pages_per_split`): :func:`default_num_splits` for the
sequences that have pages, not the launch's batch, which a CUDA graph pads with empty sequences (vLLM runs 5
requests in its graph of 8), and the longest of them; the batch's pages spread over that many programs a
sequence. :func:`pages_per_split` is the same plan on the host, :func:`planned_pages_per_split` runs the
device's for tests and benchmarks. Programs past their sequence's pages read nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quantmla.formats.windows import WindowPolicy

MAX_SPLITS = 256
PLAN_BLOCK = 128  # sequences a step of the kernels' split plan reads


@triton.jit
def paged_tokens(total, WS: tl.constexpr, WR: tl.constexpr):
    """Tokens of a sequence of ``total`` that its pages are read for, from position 0 (with shadow windows,
    ``[WS, n - WR)`` of a sequence longer than ``WS + WR`` is read from the pages, positions below ``WS``
    masked; a shorter one is all window)."""
    if WS + WR > 0:
        return tl.where(total > WS + WR, total - WR, 0)
    return total


@triton.jit
def plan_pages_per_split(NPAGED, B, HG, NS, PAGE: tl.constexpr, WS: tl.constexpr, WR: tl.constexpr,
                     SMS: tl.constexpr, MAXS: tl.constexpr, PLAN_B: tl.constexpr):  # fmt: skip
    """Pages per split, one figure for the whole launch, planned on the device from the lengths (the same
    on every program): :func:`default_num_splits` for the sequences that have pages (not the launch's
    ``B``, which a CUDA graph pads with empty ones) and the longest of them, the batch's pages spread over
    that many programs a sequence, and at most ``NS`` (the grid's) splits for the longest."""
    act = 0
    mx = 0
    tot = 0
    for i in range(0, B, PLAN_B):
        idx = i + tl.arange(0, PLAN_B)
        pg = tl.cdiv(paged_tokens(tl.load(NPAGED + idx, mask=idx < B, other=0), WS, WR), PAGE)
        act += tl.sum((pg > 0).to(tl.int32), 0)
        mx = tl.maximum(mx, tl.max(pg, 0))
        tot += tl.sum(pg, 0)
    seqs = tl.maximum(act, 1)
    bh = seqs * HG
    c8 = tl.cdiv(8 * SMS, bh)
    small = bh <= 32
    short = mx < tl.where(small, 24, 4) * c8
    per_sm = tl.where(small & (mx < 4 * c8), 2, tl.where(short, 4, 8))
    ns = tl.minimum(tl.minimum(tl.cdiv(per_sm * SMS, bh), mx), MAXS)
    ns = tl.maximum(tl.minimum(ns, NS), 1)
    return tl.maximum(tl.maximum(tl.cdiv(tot, seqs * ns), tl.cdiv(mx, NS)), 1)


@triton.jit
def split_pages(NPAGED, KSTART, b, split, NS, per, PAGE: tl.constexpr, WS: tl.constexpr, WR: tl.constexpr,
                 PLAN: tl.constexpr):  # fmt: skip
    """Paged-token count, left-padding start, the page range ``[p0, p1)`` of one split (empty past the
    sequence's pages) and how many of the sequence's splits have pages: ``per`` pages a split from
    :func:`plan_pages_per_split` (``PLAN``), else the sequence's pages over ``NS`` splits. With shadow windows
    (``WS + WR > 0``: sinks and recent window read from the shadows), ``NPAGED`` holds each sequence's
    length."""
    total = tl.load(NPAGED + b)
    n = paged_tokens(total, WS, WR)
    if WS + WR > 0:
        kstart = tl.where(total > WS + WR, WS, 0)
    else:
        kstart = tl.load(KSTART + b)  # paged tokens before this index are masked (left padding)
    npages = tl.cdiv(n, PAGE)
    if not PLAN:
        per = tl.cdiv(npages, NS)
    p0 = split * per
    p1 = tl.minimum(p0 + per, npages)
    return n, kstart, p0, p1, tl.cdiv(npages, tl.maximum(per, 1))


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off the GPU: the interpreter's stand-in)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def default_num_splits(batch: int, head_groups: int, max_pages: int, device: torch.device) -> int:
    """Splits per sequence: about eight programs per SM (more, shorter programs even out the last wave),
    but for small batches (at most 32 programs per split index) two when that would leave fewer than 4
    pages per split and four when it would leave 4-24, and for larger ones four when it would leave fewer
    than 4 (48 x 4K: 11 splits of 6 pages, not 22 of 3; 128 x 4K keeps 9, about 7 pages each); at most one
    split per page and MAX_SPLITS splits. Each split costs a partial output to write and combine, so short
    splits lose. The H200 timings behind these thresholds are in docs/notebook.md (the split plan). Integer
    arithmetic, as the kernels' own plan (:func:`plan_pages_per_split`) computes it on the device."""
    sms, bh = sm_count(device), batch * head_groups
    c8 = -(-8 * sms // bh)  # ceil(programs at eight per SM / sequences)
    small = bh <= 32
    short = max_pages < (24 if small else 4) * c8
    per_sm = 2 if small and max_pages < 4 * c8 else 4 if short else 8
    return max(1, min(max_pages, MAX_SPLITS, -(-per_sm * sms // bh)))


def split_capacity(batch: int, head_groups: int, max_pages: int, device: torch.device,
                   min_batch: int | None = None) -> int:  # fmt: skip
    """Split programs a sequence in the grid: :func:`default_num_splits` for ``batch``, or with ``min_batch``
    (a CUDA graph's batch, whose tail may be empty sequences: it replays any batch from ``min_batch`` real
    sequences up) the most it gives for any batch in ``[min_batch, batch]``. vLLM replays a batch in the
    smallest graph captured for at least as many, so that range starts one past the next smaller captured
    size (41-48 for the graph of 48). The kernels plan the splits they use on the device from the sequences
    that have pages (:func:`plan_pages_per_split`), at most this many."""
    lo = batch if min_batch is None else min_batch
    if not 1 <= lo <= batch:
        raise ValueError(f"min_batch={min_batch}: must be 1..{batch} (the graph's batch)")
    return max(default_num_splits(b, head_groups, max_pages, device) for b in range(lo, batch + 1))


def pages_per_split(n_paged: list[int], head_groups: int, capacity: int, page: int, device: torch.device,
                    sink: int = 0, recent: int = 0) -> int:  # fmt: skip
    """The kernels' split plan on the host, for lengths ``n_paged``: pages a split (see
    :func:`plan_pages_per_split`)."""
    policy = WindowPolicy(sink, recent)
    paged = [int(policy.paged_range(n)[1]) if policy.enabled else n for n in n_paged]
    pages = [-(-n // page) for n in paged]
    act = sum(1 for p in pages if p > 0)
    mx = max(pages, default=0)
    seqs = max(act, 1)
    ns = max(1, min(default_num_splits(seqs, head_groups, mx, device) if mx else 1, capacity))
    return max(-(-sum(pages) // (seqs * ns)), -(-mx // capacity), 1)


@triton.jit
def _plan_kernel(NPAGED, OUT, B, HG, NS, PAGE: tl.constexpr, WS: tl.constexpr, WR: tl.constexpr, SMS: tl.constexpr,
                 MAXS: tl.constexpr, PLAN_B: tl.constexpr):  # fmt: skip
    tl.store(OUT, plan_pages_per_split(NPAGED, B, HG, NS, PAGE, WS, WR, SMS, MAXS, PLAN_B))


def planned_pages_per_split(n_paged: torch.Tensor, head_groups: int, capacity: int, page: int, sink: int = 0,
                            recent: int = 0) -> int:  # fmt: skip
    """The decode kernels' own split plan for lengths ``n_paged`` (int32 ``[B]`` on the kernels' device), run
    on the device as the kernels run it: pages a split (for tests and benchmarks; the host form is
    :func:`pages_per_split`)."""
    out = torch.zeros(1, dtype=torch.int32, device=n_paged.device)
    _plan_kernel[(1,)](n_paged, out, n_paged.shape[0], head_groups, capacity, PAGE=page, WS=sink, WR=recent,
                       SMS=sm_count(n_paged.device), MAXS=MAX_SPLITS, PLAN_B=PLAN_BLOCK)  # fmt: skip
    return int(out.item())
