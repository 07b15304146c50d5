"""MLA decode over paged token records on the CPU: the engine's CPU path (no Python loop over requests).

Two implementations of the same float32 arithmetic: for planar 2- and 4-bit records (``c4r4``, ``c2r4``) the
fused C++ decode of :mod:`quantmla.kernels.cpu` (one pass a tile of tokens: dequantise, score every head,
online softmax, accumulate; 1.2-1.9x faster than the torch path below on a 2-core EPYC), JIT-built on first use;
where it cannot be built (no compiler or ninja: ``quantmla[cpu]``), or for other formats, the torch path
below. ``backend`` chooses (:data:`BACKENDS`) and the log says once which one ran.

For a batch of requests with block tables into field-major pages ``[num_blocks, block_size, record_bytes]``
(:meth:`~quantmla.formats.records.RecordLayout.page_view`), only the pages the batch references are
read, a chunk of pages at a time for all requests of similar length together, with an online softmax
across the chunks (weight-absorbed MQA form: ``q = [q_nope W_UK | q_pe]`` against ``[c | k^R]``, the
output in the latent space), so each decoded chunk stays in cache.

Each chunk is dequantised into one float32 tile ``[n, d_c + d_r, T]`` (channels in order, ``[c | k^R]``,
tokens innermost), so both products are one batched matrix product over all ``d_c + d_r`` channels
(scores) and ``d_c`` (output). Group-planar 2- and 4-bit codes (:func:`quantmla.formats.packing.pack_words`;
plane ``k`` of a path holds channels ``[k * pw, (k + 1) * pw)``) are transposed once to tokens innermost,
then unpacked a plane at a time with one shift and one mask over the words, and each plane lands in its
rows of the tile as ``minimum + codes * scale`` in one pass (``addcmul``; with the tokens innermost the
per-token scale and minimum broadcast over an outer dimension, which vectorises: 3x faster here than
broadcasting them over the channels). (An earlier version kept the scale and minimum folded out of the
products, one product a plane of ``pw`` channels: those small products ran at a third of the speed of one
over all channels on this CPU.) Other formats decode through
:meth:`~quantmla.formats.records.RecordLayout.unpack`. Everything computes in float32.
"""

from __future__ import annotations

import logging

import torch

from quantmla.formats.records import RecordLayout

#: tokens (over all requests of a group) decoded at once: ~9 MB of float32 tile at 512 + 64
CHUNK_TOKENS = 4096
#: ``backend`` of :func:`paged_decode`: ``auto`` takes the fused C++ decode where it applies and builds
#: (planar 2- and 4-bit records on the CPU), else the torch path; ``torch`` and ``cpp`` force one
BACKENDS = ("auto", "torch", "cpp")

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(msg: str, *args) -> None:
    key = msg % args
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(key)


class _Path:
    """How one cached path (content ``c`` or RoPE key ``r``) of a record decodes."""

    def __init__(self, layout: RecordLayout, path: str, dim: int) -> None:
        lay = layout.paths[0 if path == "c" else 1]  # the path's stored fields: format, group, planes
        self.name, self.dim, self.bits, self.group = path, dim, lay.fmt.bits, lay.group_size
        self.planar = lay.planar
        self.planes = lay.planes if self.planar else 1

    def decode_into(self, layout: RecordLayout, pages: torch.Tensor, valid: torch.Tensor, x: torch.Tensor) -> None:
        """Dequantise this path of ``pages [n, pages, block_size, record_bytes]`` (the batch's, gathered)
        into ``x [n, dim, T]`` (float32, tokens innermost: a row slice of the chunk's tile); tokens not
        ``valid [n, T]`` read as 0 (their scale and minimum are taken as 0, so garbage or NaN in unwritten
        slots stays out)."""
        n, t = valid.shape
        planes, pw = self.planes, self.dim // self.planes
        words = layout.page_view(pages, f"{self.name}_codes")  # [n, pages, block_size, bytes]: a view
        words = words.view(torch.int32 if planes * self.bits == 32 else torch.int16).reshape(n, t, pw)
        words = words.transpose(1, 2).contiguous()  # [n, pw, T]: every pass below runs along the tokens
        sm = layout.page_view(pages, f"{self.name}_sm").view(torch.float16).reshape(n, t, -1, 2).float()
        sm.masked_fill_(~valid[..., None, None], 0.0)
        sc, mn = (sm[..., i].transpose(1, 2).contiguous() for i in (0, 1))  # [n, groups, T], channel order
        tmp = torch.empty_like(words)
        mask = (1 << self.bits) - 1
        for k in range(planes):  # plane k sits at bit k * bits of every word
            torch.bitwise_right_shift(words, self.bits * k, out=tmp)
            tmp.bitwise_and_(mask)
            xk = x[:, k * pw : (k + 1) * pw]
            if self.group >= pw:  # the plane lies in one group
                g = k * pw // self.group
                torch.addcmul(mn[:, g : g + 1], tmp, sc[:, g : g + 1], out=xk)
            else:  # groups within the plane
                per = pw // self.group
                g = slice(k * per, (k + 1) * per)
                torch.addcmul(mn[:, g, None], tmp.unflatten(1, (per, self.group)), sc[:, g, None],
                              out=xk.unflatten(1, (per, self.group)))  # fmt: skip


def _paths(layout: RecordLayout) -> tuple[_Path, _Path]:
    """The content and RoPE-key paths of ``layout``'s records."""
    return _Path(layout, "c", layout.kv_lora_rank), _Path(layout, "r", layout.rope_dim)


def _decode_other(layout: RecordLayout, records: torch.Tensor, blocks: torch.Tensor, valid: torch.Tensor,
                  x: torch.Tensor) -> None:  # fmt: skip
    """Content and RoPE key of a format without planar codes into the tile ``x [n, d_c + d_r, T]`` (a
    transposed view of a ``[n, T, d_c + d_r]`` tensor)."""
    n, t = valid.shape
    x = x.transpose(1, 2)  # [n, T, d_c + d_r]: a view
    if "bf16" in layout.fields:  # [c | k^R] in BF16: vLLM's own token layout
        x.copy_(layout.page_view(records, "bf16")[blocks].view(torch.bfloat16).reshape(n, t, -1))
        x.masked_fill_(~valid[..., None], 0.0)
    else:
        c, r = layout.unpack(layout.read_pages(records[blocks]).reshape(n, t, -1), torch.float32, valid=valid)
        x[..., : layout.kv_lora_rank] = c
        x[..., layout.kv_lora_rank :] = r


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
    backend: str = "auto",
) -> torch.Tensor:
    """Attention output ``[B, H, d_c]`` (``q_nope``'s dtype) of one decode token per request.

    ``q_nope [B, H, d_c]`` (already through ``W_UK``), ``q_pe [B, H, d_r]``, ``block_table [B, >= pages]``
    (int), ``seq_lens [B]`` tokens in the pages including the new one. ``lengths``: ``seq_lens`` as host
    integers if the caller has them (saves a device-to-host copy). With windows
    (:mod:`quantmla.serving.windows`): paged positions before ``paged_start [B]`` are left out and the
    unquantised rows ``window [B, W, d_c + d_r]`` (the first ``window_len [B]`` of each) join the softmax.
    ``max_tokens``: padded tokens per group of requests (requests are grouped by length);
    ``chunk_tokens``: tokens decoded at once. ``backend``: one of :data:`BACKENDS`; which one ran is logged
    once.
    """
    fused, what = fused_decode(layout, records.device, backend)
    _log_once("quantmla paged decode: %s", what)
    paths = _paths(layout)
    if fused is not None:
        return _decode_fused(fused, q_nope, q_pe, records, layout, paths, block_table, seq_lens, scale, window,
                             window_len, paged_start)  # fmt: skip
    b, h, _ = q_nope.shape
    bs = records.shape[1]
    out = torch.empty(b, h, layout.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
    lens = lengths if lengths is not None else seq_lens.tolist()
    order = sorted(range(b), key=lens.__getitem__)
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


def fused_decode(layout: RecordLayout, device: torch.device | str, backend: str = "auto"):
    """``(extension, what)``: the fused C++ decode's extension if ``backend`` takes it for ``layout``'s records
    on ``device`` (else ``None``: the torch path), and a line for the log saying which runs and why.
    ``backend="cpp"`` where it cannot run raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "torch":
        return None, "the torch path (asked for)"
    paths = _paths(layout)
    why = None
    if torch.device(device).type != "cpu":
        why = f"the records are on {torch.device(device).type}, the fused decode runs on the CPU"
    elif not all(p.planar for p in paths):
        why = "the scheme has no planar 2- or 4-bit codes"
    if why is None:
        from quantmla.kernels.cpu.build import CPUExtensionUnavailable, extension

        try:
            return extension(), "the fused C++ decode (quantmla.kernels.cpu)"
        except CPUExtensionUnavailable as e:
            why = f"the fused CPU decode is unavailable: it needs {e}"
    if backend == "cpp":
        raise RuntimeError(f"paged_decode(backend='cpp'): {why}")
    return None, f"the torch path ({why})"


def _decode_fused(ext, q_nope, q_pe, records, layout, paths, block_table, seq_lens, scale, window, window_len,
                  paged_start) -> torch.Tensor:  # fmt: skip
    b = q_nope.shape[0]
    q = torch.cat([q_nope, q_pe], dim=-1).float().contiguous()
    width = q.shape[-1]
    desc = []
    for p in paths:
        codes_off, code_bytes = layout.fields[f"{p.name}_codes"]
        desc.append([codes_off, layout.fields[f"{p.name}_sm"][0], code_bytes, p.bits, p.planes, p.dim, p.group])
    zeros = torch.zeros(b, dtype=torch.int64)
    if window is None:
        rows, count, start = torch.zeros(b, 0, width), zeros, zeros
    else:
        rows, count, start = window.float().contiguous(), window_len.long(), paged_start.long()
    if records.stride(2) != 1 or records.stride(1) != records.shape[2]:  # pages must be contiguous, not the tensor
        records = records.contiguous()
    out = ext.paged_decode(q, records, block_table.int().contiguous(), seq_lens.long(), start, rows,
                           count, float(scale), desc[0], desc[1])  # fmt: skip
    return out.to(q_nope.dtype)


def _attend(q_nope, q_pe, records, layout, paths, blocks, seq_lens, scale, win, per_chunk) -> torch.Tensor:
    n, h, dc = q_nope.shape
    bs = records.shape[1]
    width = dc + q_pe.shape[-1]
    planar = all(p.planar for p in paths)
    q = torch.cat([q_nope, q_pe], dim=-1).float()  # [n, h, d_c + d_r]
    dev = q_nope.device
    m = torch.full((n, h, 1), float("-inf"), device=dev)
    l_sum = torch.zeros(n, h, 1, device=dev)
    acc = torch.zeros(n, h, dc, device=dev)

    def attend(x, mask):  # one tile [n, d_c + d_r, T] of both paths: online softmax
        nonlocal m, l_sum, acc
        s = torch.matmul(q, x).mul_(scale).masked_fill_(~mask[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(m - safe)
        p = torch.exp(s - safe)  # [n, h, T]
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, x[:, :dc].transpose(1, 2))
        m = m_new

    if win is not None:  # the unquantised rows: one more tile of the same softmax
        rows, count, _ = win
        attend(rows.float().transpose(1, 2), torch.arange(rows.shape[1], device=dev)[None, :] < count[:, None].long())
    start = None if win is None else win[2].long()
    for p0 in range(0, blocks.shape[1], per_chunk):
        blk = blocks[:, p0 : p0 + per_chunk]
        t = p0 * bs + torch.arange(blk.shape[1] * bs, device=dev)
        valid = t[None, :] < seq_lens[:, None]
        if start is not None:
            valid &= t[None, :] >= start[:, None]  # the sinks: read from the window rows instead
        # the tile [n, d_c + d_r, T]; tokens innermost in memory for planar codes, channels for the others
        x = torch.empty(n, *((width, t.shape[0]) if planar else (t.shape[0], width)), device=dev)
        x = x if planar else x.transpose(1, 2)
        if planar:  # whole pages gathered at once (row copies), the fields read as views of them
            pages = records.index_select(0, blk.flatten()).view(*blk.shape, *records.shape[1:])
            paths[0].decode_into(layout, pages, valid, x[:, :dc])
            paths[1].decode_into(layout, pages, valid, x[:, dc:])
        else:
            _decode_other(layout, records, blk, valid, x)
        attend(x, valid)
    return (acc / torch.where(l_sum > 0, l_sum, 1.0)).to(q_nope.dtype)
