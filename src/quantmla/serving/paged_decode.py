"""MLA decode over paged token records in torch: the engine's CPU path (no Python loop over requests).

For a batch of requests with block tables into field-major pages ``[num_blocks, block_size, record_bytes]``
(:meth:`~quantmla.serving.records.RecordLayout.page_view`),
only the pages the batch references are gathered, dequantised once and attended in one softmax per
request and head (weight-absorbed MQA form: ``q = [q_nope W_UK | q_pe]`` against ``[c | k^R]``, the
output in the latent space). Requests are processed in chunks of similar token counts so the
dequantised tile stays within ``max_tokens`` tokens.
"""

from __future__ import annotations

import torch

from quantmla.serving.records import RecordLayout


def paged_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    records: torch.Tensor,
    layout: RecordLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_tokens: int = 1 << 16,
    lengths: list[int] | None = None,
    window: torch.Tensor | None = None,
    window_len: torch.Tensor | None = None,
    paged_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``[B, H, d_c]`` (``q_nope``'s dtype) of one decode token per request.

    ``q_nope [B, H, d_c]`` (already through ``W_UK``), ``q_pe [B, H, d_r]``, ``block_table [B, >= pages]``
    (int), ``seq_lens [B]`` tokens in the pages including the new one. ``lengths``: ``seq_lens`` as host
    integers if the caller has them (saves a device-to-host copy). With windows
    (:mod:`quantmla.serving.windows`): paged positions before ``paged_start [B]`` are left out and the
    unquantised rows ``window [B, W, d_c + d_r]`` (the first ``window_len [B]`` of each) join the softmax.
    """
    b, h, _ = q_nope.shape
    bs = records.shape[1]
    out = torch.empty(b, h, layout.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
    lens = lengths if lengths is not None else seq_lens.tolist()
    order = sorted(range(b), key=lens.__getitem__)
    i = 0
    while i < b:  # chunks of requests sorted by length: each chunk pads to its own longest request
        j = i + 1
        while j < b and (j - i + 1) * lens[order[j]] <= max_tokens:
            j += 1
        idx = torch.tensor(order[i:j], device=q_nope.device)
        pages = -(-max(lens[order[j - 1]], 1) // bs)  # at least one page, even with every token in the window
        win = None
        if window is not None:
            win = (window[idx], window_len[idx], paged_start[idx])
        out[idx] = _attend(q_nope[idx], q_pe[idx], records, layout, block_table[idx, :pages], seq_lens[idx], scale,
                           win)  # fmt: skip
        i = j
    return out


def _attend(q_nope, q_pe, records, layout, blocks, seq_lens, scale, win=None) -> torch.Tensor:
    n, pages = blocks.shape
    rec = layout.read_pages(records[blocks.long()]).reshape(n, pages * records.shape[1], -1)  # [n, T, bytes]
    t = torch.arange(rec.shape[1], device=rec.device)
    skip = t[None, :] >= seq_lens[:, None].long()  # slots past each request's end: unwritten bytes
    if win is not None:
        skip |= t[None, :] < win[2][:, None].long()  # the sinks: read from the window rows instead
    c, r = layout.unpack(rec, torch.float32, valid=~skip)  # they read as 0 (NaN bytes would leak into P c)
    qn, qp = q_nope.float(), q_pe.float()
    s = torch.einsum("nhd,ntd->nht", qn, c) + torch.einsum("nhd,ntd->nht", qp, r)
    s = s.mul_(scale).masked_fill_(skip[:, None, :], float("-inf"))
    if win is None:
        return torch.einsum("nht,ntd->nhd", torch.softmax(s, dim=-1), c).to(q_nope.dtype)
    # the unquantised rows join the same softmax (their scores beside the pages', no copy of the pages)
    rows, count = win[0].float(), win[1].long()
    cw, rw = rows[..., : layout.kv_lora_rank], rows[..., layout.kv_lora_rank :]
    sw = torch.einsum("nhd,ntd->nht", qn, cw) + torch.einsum("nhd,ntd->nht", qp, rw)
    gone = torch.arange(rows.shape[1], device=rec.device)[None, :] >= count[:, None]
    sw = sw.mul_(scale).masked_fill_(gone[:, None, :], float("-inf"))
    p = torch.softmax(torch.cat([s, sw], dim=-1), dim=-1)
    t = s.shape[-1]
    out = torch.einsum("nht,ntd->nhd", p[..., :t], c) + torch.einsum("nht,ntd->nhd", p[..., t:], cw)
    return out.to(q_nope.dtype)
