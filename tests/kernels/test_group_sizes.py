"""The low-bit decode kernel at every quantisation group size the paged layout accepts, against a float64
reference built from the stored codes, scales and minima (not from the store's own read path).

A RoPE key of 64 channels is four planes of 16: with ``group_size < rope_dim`` each plane has its own
scale word, which the kernel once ignored (it read word 0 for all four planes: rel. error 0.9 at group
32). The content path is checked at the same group sizes (one group per plane at the smallest).
"""

import itertools
import math

import pytest
import torch

from quantmla.formats.packing import CONTENT_PLANES, ROPE_PLANES, unpack_words
from quantmla.kernels import PagedLatentStore, PagedLayout
from quantmla.kernels.layout import NoKernelLayout

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
from quantmla.kernels.decode import mla_decode  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"

# (kv_lora_rank, rope_dim, group_size): every combination of these dims the layout accepts
GEOMETRIES = [
    (128, 64, 16), (128, 64, 32), (128, 64, 64), (128, 128, 32), (128, 128, 64), (128, 128, 128),
    (256, 64, 32), (256, 64, 64), (256, 128, 32), (256, 128, 64), (256, 128, 128),
    (512, 64, 64), (512, 128, 64), (512, 128, 128),
]  # fmt: skip


def test_geometries_are_every_accepted_group_size():
    accepted = []
    for dc, dr, g in itertools.product((64, 128, 256, 512), (32, 64, 128), (8, 16, 32, 64, 128, 256)):
        try:
            PagedLayout(4, 4, kv_lora_rank=dc, rope_dim=dr, group_size=g)
        except NoKernelLayout:
            continue
        accepted.append((dc, dr, g))
    assert accepted == sorted(GEOMETRIES)


def _dequant64(codes_u8, sm, bits, planes, g):
    codes = unpack_words(codes_u8, bits, planes).double()
    s, m = sm[..., 0].double(), sm[..., 1].double()
    return (codes.unflatten(-1, (-1, g)) * s[..., None] + m[..., None]).flatten(-2)


def reference64(q, qr, store, bt, n_paged, scale, fp16=False):
    """float64 attention over the stored tokens; ``fp16``: round the dequantised cache and the
    probabilities to fp16 as the kernel does (the precision its error is compared with)."""
    lay = store.layout
    B, H, DC = q.shape
    o = torch.zeros(B, H, DC, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(n_paged[b])
        idx = torch.arange(n)
        pages, slots = bt[b, idx // lay.page_size].long().cpu(), idx % lay.page_size
        f = {name: store.field(name).cpu()[pages, slots] for name in ("c_codes", "c_sm", "r_codes", "r_sm")}
        c_sm, r_sm = (f[k].view(torch.float16).unflatten(-1, (-1, 2)) for k in ("c_sm", "r_sm"))  # (scale, minimum)
        c = _dequant64(f["c_codes"], c_sm, lay.content_bits, CONTENT_PLANES, lay.group_size)
        r = _dequant64(f["r_codes"], r_sm, 4, ROPE_PLANES, lay.group_size)
        qb, qrb = q[b].double().cpu(), qr[b].double().cpu()
        if fp16:
            c, r, qb, qrb = (x.half().double() for x in (c, r, qb, qrb))
        s = (qb @ c.T + qrb @ r.T) * scale
        p = torch.softmax(s, -1)
        o[b] = (p.half().double() if fp16 else p) @ c
        lse[b] = torch.logsumexp(s, -1)
    return o, lse


def run_case(dc, dr, g, content_bits, H, lens, page, seed, splits=None):
    gen = torch.Generator().manual_seed(seed)
    lay = PagedLayout(content_bits, 4, kv_lora_rank=dc, rope_dim=dr, group_size=g, page_size=page)
    maxp = max(math.ceil(n / page) for n in lens)
    store = PagedLatentStore(lay, len(lens) * maxp + 2, device=DEV)
    bt = torch.randperm(store.num_pages, generator=gen)[: len(lens) * maxp].view(len(lens), maxp).int().to(DEV)
    for b, n in enumerate(lens):
        idx = torch.arange(n, device=DEV)
        c = torch.randn(n, dc, generator=gen)
        r = torch.randn(n, dr, generator=gen)
        # groups of very different ranges, so that a scale word read for the wrong group shows
        c = c * torch.logspace(-1, 1, dc // g).repeat_interleave(g)
        r = r * torch.logspace(1, -1, dr // g).repeat_interleave(g) + torch.arange(dr // g).repeat_interleave(g)
        store.write(bt[b, idx // page].long(), idx % page, c.to(DEV), r.to(DEV))
    q = torch.randn(len(lens), H, dc, generator=gen).bfloat16().to(DEV)
    qr = torch.randn(len(lens), H, dr, generator=gen).bfloat16().to(DEV)
    n_paged = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(dc + dr)
    o, lse = mla_decode(q, qr, store, bt, n_paged, scale, num_splits=splits, out_dtype=torch.float32)
    ref_o, ref_lse = reference64(q, qr, store, bt, n_paged, scale)
    half_o, half_lse = reference64(q, qr, store, bt, n_paged, scale, fp16=True)
    o, lse = o.double().cpu(), lse.double().cpu()
    err = (o - ref_o).norm() / ref_o.norm()
    base = (half_o - ref_o).norm() / ref_o.norm()
    assert err <= 2 * base + 1e-4, (float(err), float(base))  # no worse than twice fp16 rounding's own error
    lse_err, lse_base = (lse - ref_lse).abs().max(), (half_lse - ref_lse).abs().max()
    assert lse_err <= 2 * lse_base + 1e-4, (float(lse_err), float(lse_base))


@pytest.mark.parametrize("H", [16, 20], ids=["one-load-scales", "per-plane-scales"])  # BLOCK_H 16 and 32
@pytest.mark.parametrize("content_bits", [4, 2], ids=["c4r4", "c2r4"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda x: "dc{}-dr{}-g{}".format(*x))
def test_group_sizes_against_float64(geometry, content_bits, H):
    run_case(*geometry, content_bits, H, lens=[37, 20], page=16, seed=sum(geometry) + H, splits=2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (the inline-PTX unpack path)")
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("content_bits", [4, 2], ids=["c4r4", "c2r4"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda x: "dc{}-dr{}-g{}".format(*x))
def test_group_sizes_gpu(geometry, content_bits, H):
    run_case(*geometry, content_bits, H, lens=[4099, 1000, 64, 1], page=64, seed=sum(geometry) + H)
