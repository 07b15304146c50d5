"""Pure-torch reference of :func:`quantmla.kernels.decode.mla_decode` (dequantise, then attend in fp32)."""

from __future__ import annotations

import torch

from quantmla.kernels.layout import PagedLatentStore


def gather_tokens(store: PagedLatentStore, block_table: torch.Tensor, n: int, b: int):
    """Dequantised ``(c [n, d_c], r [n, d_r])`` of sequence ``b``'s first ``n`` paged tokens."""
    page = store.layout.page_size
    idx = torch.arange(n, device=block_table.device)
    pages = block_table[b, idx // page].long()
    return store.read(pages, idx % page)


def mla_decode_reference(
    q_lat, q_pe, store, block_table, n_paged, scale, window=None, window_len=None, paged_start=None, window_skip=None
):
    """Returns float32 ``o_lat [B, H, d_c]`` and ``lse [B, H]``; same arguments as ``mla_decode``. Queries
    ``[B, S, H, d]`` (``S`` query tokens a sequence, no window): token ``t`` attends to the first
    ``n_paged - S + 1 + t`` tokens; outputs ``[B, S, H, d_c]`` and ``[B, S, H]``."""
    if q_lat.dim() == 4:
        if window is not None:
            raise ValueError("several query tokens a sequence take no window buffer")
        S = q_lat.shape[1]
        outs = [
            mla_decode_reference(
                q_lat[:, t],
                q_pe[:, t],
                store,
                block_table,
                (n_paged - (S - 1 - t)).clamp_min(0),
                scale,
                paged_start=paged_start,
            )  # fmt: skip
            for t in range(S)
        ]
        return torch.stack([o for o, _ in outs], 1), torch.stack([lse for _, lse in outs], 1)
    B, H, DC = q_lat.shape
    o = torch.zeros(B, H, DC, dtype=torch.float32, device=q_lat.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    for b in range(B):
        c, r = gather_tokens(store, block_table, int(n_paged[b]), b)
        if paged_start is not None:
            c, r = c[int(paged_start[b]) :], r[int(paged_start[b]) :]
        if window is not None:
            w = window[b, : int(window_len[b])].float()
            if window_skip is not None:
                w = w[int(window_skip[b]) :]
            c, r = torch.cat([c, w[:, :DC]]), torch.cat([r, w[:, DC:]])
        if c.shape[0] == 0:
            continue
        s = (q_lat[b].float() @ c.T + q_pe[b].float() @ r.T) * scale  # [H, n]
        lse[b] = torch.logsumexp(s, dim=-1)
        o[b] = torch.softmax(s, dim=-1) @ c
    return o, lse
