"""Field-major record pages read in place by the decode kernels: same bytes per page as the kernels'
own store, same outputs, a float64 reference (CPU: Triton's interpreter)."""

import pytest
import torch

from quantmla.formats.records import RecordLayout
from quantmla.kernels import PagedLatentStore, PagedLayout
from quantmla.kernels.layout import NoKernelLayout

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BITS = {"bf16": (16, 16), "c4r4": (4, 4), "c2r4": (2, 4)}


def _fill(scheme: str, lens, dc=128, page=16, seed=0, pad=0):
    """The same tokens written into field-major pages and into the kernels' store, at the same pages; ``pad``: bytes
    added to each record (an engine whose layers share the largest layer's record)."""
    g = torch.Generator().manual_seed(seed)
    rec = RecordLayout(scheme, dc, 64, 64)
    if pad:
        rec = RecordLayout(scheme, dc, 64, 64, pad_to=rec.record_bytes + pad)
    store = PagedLatentStore(PagedLayout(*BITS[scheme], kv_lora_rank=dc, rope_dim=64, page_size=page), 12, DEV)
    pages = torch.randint(0, 256, (12, page, rec.record_bytes), generator=g, dtype=torch.uint8).to(DEV)
    maxp = -(-max(lens) // page)
    bt = torch.randperm(12, generator=g)[: len(lens) * maxp].view(len(lens), maxp).int().to(DEV)
    for b, n in enumerate(lens):
        idx = torch.arange(n, device=DEV)
        c, r = (torch.randn(n, dc, generator=g) * 2).to(DEV), (torch.randn(n, 64, generator=g) * 2).to(DEV)
        blk = bt[b, idx // page].long()
        store.write(blk, idx % page, c, r)
        rec.write_pages(pages, blk * page + idx % page, c, r)
    return rec, store, pages, bt


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4", "bf16"])
def test_each_field_of_a_page_is_the_kernel_stores_page(scheme):
    rec, store, pages, bt = _fill(scheme, [37, 16, 5])
    kp = PagedLatentStore.from_pages(pages, rec)
    used = bt.flatten().long()
    mask = torch.zeros(12, 16, dtype=torch.bool, device=DEV)  # slots written (others hold random bytes)
    for b, n in enumerate([37, 16, 5]):
        for t in range(n):
            mask[bt[b, t // 16], t % 16] = True
    if scheme == "bf16":
        assert torch.equal(kp.content[mask], store.content[mask])
        return
    for got, want in zip(kp.kernel_views(), store.kernel_views(), strict=True):
        assert got.data_ptr() >= pages.data_ptr() and got.stride(0) * got.element_size() == pages.stride(0)
        assert torch.equal(got[mask], want.reshape(*want.shape[:2], -1)[mask])
    assert used.numel() > 0


def test_schemes_without_a_kernel_say_why():
    pages = torch.zeros(4, 64, RecordLayout("c8r8").record_bytes, dtype=torch.uint8)
    with pytest.raises(NoKernelLayout, match="INT8"):
        PagedLatentStore.from_pages(pages, RecordLayout("c8r8"))
    with pytest.raises(ValueError, match="uint8"):
        PagedLatentStore.from_pages(pages.float(), RecordLayout("c8r8"))


def test_has_kernel_is_what_the_pages_store_accepts():
    """``has_kernel`` answers for the record's scheme, widths and group together: exactly where ``from_pages``
    builds a store (C4R4 in groups of 32 has content planes of 64 channels, wider than its groups)."""
    from quantmla.kernels.layout import has_kernel

    for scheme, group in [("c4r4", 64), ("c2r4", 64), ("bf16", 64), ("c4r4", 32), ("c8r8", 64), ("fp8", 64)]:
        lay = RecordLayout(scheme, 512, 64, group)
        pages = torch.zeros(2, 64, lay.record_bytes, dtype=torch.uint8)
        try:
            PagedLatentStore.from_pages(pages, lay)
            accepted = True
        except NoKernelLayout:
            accepted = False
        assert has_kernel(lay) == accepted, (scheme, group)
    assert not has_kernel(RecordLayout("c4r4", 512, 64, 32))


@pytest.mark.parametrize("pad", [0, 144])
@pytest.mark.parametrize("scheme", ["c4r4", "c2r4", "bf16"])
def test_decode_over_pages_in_place_equals_the_kernel_store(scheme, pad):
    """``pad``: records padded (a per-layer codec's engine pages every layer at the largest record)."""
    pytest.importorskip("triton", reason="triton is an optional dependency")
    from quantmla.kernels.decode import mla_decode

    lens = [37, 16, 5]
    rec, store, pages, bt = _fill(scheme, lens, seed=3, pad=pad)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 16, 128, generator=g).bfloat16().to(DEV)
    qr = torch.randn(3, 16, 64, generator=g).bfloat16().to(DEV)
    n = torch.tensor(lens, dtype=torch.int32, device=DEV)
    got, lse = mla_decode(q, qr, PagedLatentStore.from_pages(pages, rec), bt, n, 0.1)
    want, want_lse = mla_decode(q, qr, store, bt, n, 0.1)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    for b, length in enumerate(lens):  # float64 attention over the tokens read back from the pages
        idx = torch.arange(length, device=DEV)
        c, r = rec.unpack(rec.read_slots(pages, bt[b, idx // 16].long() * 16 + idx % 16), torch.float64)
        p = torch.softmax((q[b].double() @ c.T + qr[b].double() @ r.T) * 0.1, dim=-1)
        torch.testing.assert_close(got[b].double(), p @ c, rtol=2e-2, atol=2e-2)
