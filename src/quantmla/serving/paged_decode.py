"""MLA decode over paged token records in torch: the engine's CPU path (no Python loop over requests).

For a batch of requests with block tables into field-major pages ``[num_blocks, block_size, record_bytes]``
(:meth:`~quantmla.serving.records.RecordLayout.page_view`), only the pages the batch references are
read, a chunk of pages at a time for all requests of similar length together, with an online softmax
across the chunks (weight-absorbed MQA form: ``q = [q_nope W_UK | q_pe]`` against ``[c | k^R]``, the
output in the latent space), so each decoded chunk stays in cache.

Group-planar 2- and 4-bit codes (:func:`quantmla.kernels.layout.pack_words`) are unpacked word-wise into
float32 *planes* (plane ``k`` of a path holds channels ``[k * pw, (k + 1) * pw)``: ``[n, planes, T, pw]``),
and scale and minimum are folded out of the products instead of applied to every value. With scale
``S[k, t]`` and minimum ``M[k, t]`` of plane ``k`` (groups of at least a plane):

* ``s[h, t] = sum_k S[k, t] (q_k[h] . codes_k[t]) + M[k, t] sum(q_k[h])``;
* ``o_k[h] = (p[h] * S[k]) @ codes_k + p[h] @ M[k]``.

Groups smaller than a plane are applied in place first. Other formats decode through
:meth:`~quantmla.serving.records.RecordLayout.unpack` as one plane. Everything computes in float32.
"""

from __future__ import annotations

import torch

from quantmla.kernels.layout import CONTENT_PLANES, ROPE_PLANES
from quantmla.serving.records import RecordLayout

#: tokens (over all requests of a group) decoded at once: ~9 MB of float32 planes at 512 + 64 (the fastest
#: of 1K-8K on a 2-core Xeon)
CHUNK_TOKENS = 4096


class _Path:
    """How one cached path (content ``c`` or RoPE key ``r``) of a record decodes."""

    def __init__(self, layout: RecordLayout, path: str, dim: int) -> None:
        fmt = getattr(layout.cache_scheme, "content" if path == "c" else "rope")
        self.name, self.dim, self.bits, self.group = path, dim, fmt.bits, layout.group_size
        self.planar = fmt.kind == "int" and fmt.bits in (2, 4)
        self.planes = (CONTENT_PLANES if path == "c" else ROPE_PLANES) if self.planar else 1

    def decode(self, layout: RecordLayout, pages: torch.Tensor, valid: torch.Tensor):
        """Planes ``x [n, planes, T, pw]`` (float32) of ``pages [n, pages, block_size, record_bytes]`` (the
        batch's, gathered) and per-plane scale and minimum ``S, M [n, planes, T]`` (``None``: applied
        already); tokens not ``valid [n, T]`` read as 0."""
        n, t = valid.shape
        planes, pw = self.planes, self.dim // self.planes
        words = layout.page_view(pages, f"{self.name}_codes")  # [n, pages, block_size, bytes]: a view
        words = words.view(torch.int32 if planes * self.bits == 32 else torch.int16)  # [..., pw]
        x = torch.empty(n, planes, t, pw, dtype=torch.float32, device=pages.device)
        tmp = torch.empty(words.shape, dtype=words.dtype, device=words.device)
        mask = (1 << self.bits) - 1
        for k in range(planes):  # plane k sits at bit k * bits of every word
            torch.bitwise_right_shift(words, self.bits * k, out=tmp)
            x[:, k].view(tmp.shape).copy_(tmp.bitwise_and_(mask))
        sm = layout.page_view(pages, f"{self.name}_sm").view(torch.float16).reshape(n, t, -1, 2).float()
        sm.masked_fill_(~valid[..., None, None], 0.0)  # unwritten slots: scale and minimum 0
        sc, mn = sm[..., 0].transpose(1, 2), sm[..., 1].transpose(1, 2)  # [n, groups, T]
        if self.group >= pw:  # a group spans group / pw whole planes
            rep = self.group // pw
            return x, sc.repeat_interleave(rep, dim=1), mn.repeat_interleave(rep, dim=1)
        per = pw // self.group  # groups within a plane: applied in place
        xv = x.view(n, planes, t, per, self.group)
        xv.mul_(sc.reshape(n, planes, per, t).transpose(-1, -2)[..., None])
        xv.add_(mn.reshape(n, planes, per, t).transpose(-1, -2)[..., None])
        return x, None, None


def _decode_other(layout: RecordLayout, records: torch.Tensor, blocks: torch.Tensor, valid: torch.Tensor):
    """Content and RoPE key as one plane each, ``[n, 1, T, d]`` (float32), of a format without planar codes."""
    n, t = valid.shape
    if "bf16" in layout.fields:  # [c | k^R] in BF16: vLLM's own token layout
        x = layout.page_view(records, "bf16")[blocks].view(torch.bfloat16).reshape(n, t, -1).float()
        x = x.masked_fill_(~valid[..., None], 0.0)
        c, r = x[..., : layout.kv_lora_rank], x[..., layout.kv_lora_rank :]
    else:
        c, r = layout.unpack(layout.read_pages(records[blocks]).reshape(n, t, -1), torch.float32, valid=valid)
    return [(c[:, None], None, None), (r[:, None], None, None)]


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
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """Attention output ``[B, H, d_c]`` (``q_nope``'s dtype) of one decode token per request.

    ``q_nope [B, H, d_c]`` (already through ``W_UK``), ``q_pe [B, H, d_r]``, ``block_table [B, >= pages]``
    (int), ``seq_lens [B]`` tokens in the pages including the new one. ``lengths``: ``seq_lens`` as host
    integers if the caller has them (saves a device-to-host copy). With windows
    (:mod:`quantmla.serving.windows`): paged positions before ``paged_start [B]`` are left out and the
    unquantised rows ``window [B, W, d_c + d_r]`` (the first ``window_len [B]`` of each) join the softmax.
    ``max_tokens``: padded tokens per group of requests (requests are grouped by length);
    ``chunk_tokens``: tokens decoded at once.
    """
    b, h, _ = q_nope.shape
    bs = records.shape[1]
    out = torch.empty(b, h, layout.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
    lens = lengths if lengths is not None else seq_lens.tolist()
    order = sorted(range(b), key=lens.__getitem__)
    paths = (_Path(layout, "c", layout.kv_lora_rank), _Path(layout, "r", layout.rope_dim))
    i = 0
    while i < b:  # groups of requests sorted by length: each group pads to its own longest request
        j = i + 1
        while j < b and (j - i + 1) * lens[order[j]] <= max_tokens:
            j += 1
        idx = torch.tensor(order[i:j], device=q_nope.device)
        pages = -(-max(lens[order[j - 1]], 1) // bs)  # at least one page, even with every token in the window
        win = None
        if window is not None:
            win = (window[idx], window_len[idx], paged_start[idx])
        per_chunk = max(1, chunk_tokens // (bs * (j - i)))
        out[idx] = _attend(q_nope[idx], q_pe[idx], records, layout, paths, block_table[idx, :pages].long(),
                           seq_lens[idx].long(), scale, win, per_chunk)  # fmt: skip
        i = j
    return out


def _attend(q_nope, q_pe, records, layout, paths, blocks, seq_lens, scale, win, per_chunk) -> torch.Tensor:
    n, h, dc = q_nope.shape
    bs = records.shape[1]
    planar = all(p.planar for p in paths)
    planes = [p.planes if planar else 1 for p in paths]
    qs = [q.float().view(n, h, k, -1).transpose(1, 2) for q, k in zip((q_nope, q_pe), planes, strict=True)]
    qsum = [q.sum(-1) for q in qs]  # [n, planes, h]: for the minima
    dev = q_nope.device
    m = torch.full((n, h, 1), float("-inf"), device=dev)
    l_sum = torch.zeros(n, h, 1, device=dev)
    acc = torch.zeros(n, planes[0], h, dc // planes[0], device=dev)  # the content planes of the output

    def attend(parts, mask):  # one tile of both paths: online softmax
        nonlocal m, l_sum, acc
        s = 0.0
        for q, qm, (x, sc, mn) in zip(qs, qsum, parts, strict=True):
            raw = torch.matmul(q, x.transpose(-1, -2))  # [n, planes, h, T]
            if sc is not None:
                raw = raw.mul_(sc[:, :, None, :]).add_(mn[:, :, None, :] * qm[..., None])
            s = s + raw.sum(1)
        s = s.mul_(scale).masked_fill_(~mask[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(m - safe)
        p = torch.exp(s - safe)  # [n, h, T]
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        x, sc, mn = parts[0]
        if sc is None:
            o = torch.matmul(p[:, None], x)
        else:
            o = torch.matmul(p[:, None] * sc[:, :, None, :], x).add_(torch.matmul(p[:, None], mn[..., None]))
        acc = acc * alpha[:, None] + o
        m = m_new

    if win is not None:  # the unquantised rows: one more tile of the same softmax
        rows, count, _ = win
        rows = rows.float()
        t = rows.shape[1]
        wc = rows[..., :dc].reshape(n, t, planes[0], -1).transpose(1, 2)
        wr = rows[..., dc:].reshape(n, t, planes[1], -1).transpose(1, 2)
        attend([(wc, None, None), (wr, None, None)], torch.arange(t, device=dev)[None, :] < count[:, None].long())
    start = None if win is None else win[2].long()
    for p0 in range(0, blocks.shape[1], per_chunk):
        blk = blocks[:, p0 : p0 + per_chunk]
        t = p0 * bs + torch.arange(blk.shape[1] * bs, device=dev)
        valid = t[None, :] < seq_lens[:, None]
        if start is not None:
            valid &= t[None, :] >= start[:, None]  # the sinks: read from the window rows instead
        if planar:  # whole pages gathered at once (row copies), the fields read as views of them
            pages = records.index_select(0, blk.flatten()).view(*blk.shape, *records.shape[1:])
            parts = [p.decode(layout, pages, valid) for p in paths]
        else:
            parts = _decode_other(layout, records, blk, valid)
        attend(parts, valid)
    o = acc / torch.where(l_sum > 0, l_sum, 1.0)[:, None]  # [n, planes, h, pw]
    return o.transpose(1, 2).reshape(n, h, dc).to(q_nope.dtype)
