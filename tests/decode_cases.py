"""Decode-kernel test cases shared by the kernel tests: a paged store with random tokens, NaN-poisoned unused
pages, a permuted block table, windows and queries."""

import math

import torch

from quantmla.kernels import PagedLatentStore, PagedLayout

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
