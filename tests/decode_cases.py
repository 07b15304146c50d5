"""Decode-kernel test cases shared by the kernel tests: a paged store with random tokens, NaN-poisoned unused
pages, a permuted block table, windows and queries."""

import math

import numpy as np
import torch

from quantmla.formats.records import RecordLayout
from quantmla.kernels import PagedLatentStore, PagedLayout
from quantmla.kernels.write import write_records
from quantmla.serving.windows import ShadowRows, WindowPool

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMES = [(16, 16), (4, 4), (2, 4)]  # (content bits, RoPE bits): BF16, C4R4, C2R4


def make_case(content_bits, rope_bits, lens, window_lens, H, dc=128, page=16, seed=0, poison=True):
    g = torch.Generator().manual_seed(seed)
    lay = PagedLayout(content_bits, rope_bits, kv_lora_rank=dc, rope_dim=64, page_size=page)
    B = len(lens)
    maxp = max(1, max(math.ceil(n / page) for n in lens))
    num_pages = B * maxp + 3
    store = PagedLatentStore(lay, num_pages, device=DEV)
    if poison:  # unused pages hold NaN (or NaN scales): they must never be read
        for name in store.records.fields:
            f = store.field(name)
            if name == "bf16":
                f.view(torch.bfloat16).fill_(float("nan"))
            elif name.endswith("_sm"):
                f.view(torch.float16).fill_(float("nan"))
            else:
                f.copy_(torch.randint(0, 256, f.shape, generator=g).to(f.dtype).to(DEV))
    bt = torch.randperm(num_pages, generator=g)[: B * maxp].view(B, maxp).int().to(DEV)
    for b, n in enumerate(lens):
        if n:
            idx = torch.arange(n, device=DEV)
            c = (torch.randn(n, dc, generator=g) * 2).to(DEV)
            r = (torch.randn(n, 64, generator=g) * 2).to(DEV)
            store.write(bt[b, idx // page].long(), idx % page, c, r)
    cap = max(1, max(window_lens))
    window = torch.randn(B, cap, dc + 64, generator=g).bfloat16().to(DEV)
    for b, w in enumerate(window_lens):
        window[b, w:] = float("nan")
    q = torch.randn(B, H, dc, generator=g).bfloat16().to(DEV)
    qr = torch.randn(B, H, 64, generator=g).bfloat16().to(DEV)
    n_paged = torch.tensor(lens, dtype=torch.int32, device=DEV)
    wl = torch.tensor(window_lens, dtype=torch.int32, device=DEV)
    return q, qr, store, bt, n_paged, window, wl


def shadow_engine(scheme: str, cfg, seed: int = 0, last: int = 1, dc: int = 128, lens=(150, 40, 7)):
    """Three requests written in two steps (prompt, then ``last`` tokens each, planned as decode tokens) by the
    fused write with shadows."""
    g = torch.Generator().manual_seed(seed)
    bs = 32
    lay = RecordLayout(scheme, dc, 64, 64)
    nb = 24
    pages = torch.zeros(nb, bs, lay.record_bytes, dtype=torch.uint8, device=DEV)
    pool = WindowPool(cfg, nb * bs, len(lens), DEV)
    shadow = ShadowRows(cfg, len(lens), dc + 64, torch.bfloat16, DEV)
    ref = ShadowRows(cfg, len(lens), dc + 64, torch.bfloat16, DEV)  # the torch write, for comparison
    maxp = -(-max(lens) // bs)
    table = torch.randperm(nb - 1, generator=g)[: len(lens) * maxp].add(1).view(len(lens), maxp).int().to(DEV)
    tokens = [(torch.randn(n, dc + 64, generator=g) * 2).bfloat16().to(DEV) for n in lens]
    for step, grow in enumerate(([n - last for n in lens], [last] * len(lens))):
        done = [len(t) - k for t, k in zip(tokens, grow, strict=True)] if step else [0] * len(lens)
        seq = np.array([d + k for d, k in zip(done, grow, strict=True)])
        short = np.ones(len(lens), dtype=bool) if step else None
        granted = pool.plan(table.cpu().numpy(), seq, np.array(grow), bs, short=short)
        assert granted.all() or not step  # the step's tokens attend as decode tokens (the prompts as prefills)
        pos = torch.cat([torch.arange(d, d + k) for d, k in zip(done, grow, strict=True)]).to(DEV)
        req = torch.cat([torch.full((k,), i) for i, k in enumerate(grow)]).to(DEV)
        slots = table[req, pos // bs].long() * bs + pos % bs
        x = torch.stack([tokens[i][p] for i, p in zip(req.tolist(), pos.tolist(), strict=True)])
        write_records(lay, pages, slots, x[:, :dc], x[:, dc:], shadow_rows=shadow.rows, shadow_map=pool.map)
        ref.write(pool, slots, x[:, :dc], x[:, dc:])
    return lay, pages, pool, shadow, ref, table, tokens


def float64_decode(q4, qr4, store, bt, n, scale, start=None):
    """Float64 reference of a decode step of ``S`` query tokens (``[B, S, H, d]``): token ``t`` over stored tokens
    ``[start, n - S + 1 + t)`` of its sequence (``start``: left padding, default 0)."""
    from quantmla.kernels.reference import gather_tokens

    B, S, H, _ = q4.shape
    o = torch.zeros(B, S, H, q4.shape[-1], dtype=torch.float64)
    lse = torch.full((B, S, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        k0 = 0 if start is None else int(start[b])
        for t in range(S):
            m = int(n[b]) - (S - 1 - t)
            if m <= k0:
                continue
            c, r = gather_tokens(store, bt, m, b)
            c, r = c[k0:].double().cpu(), r[k0:].double().cpu()
            s = (q4[b, t].double().cpu() @ c.T + qr4[b, t].double().cpu() @ r.T) * scale
            lse[b, t] = torch.logsumexp(s, -1)
            o[b, t] = torch.softmax(s, -1) @ c
    return o, lse
