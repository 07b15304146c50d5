"""The fused cache read equals the torch read of the same records bit for bit, shadows included (CPU:
Triton's interpreter)."""

import pytest
import torch

from quantmla.formats.records import RecordLayout
from quantmla.formats.windows import SUB
from quantmla.kernels.gather import gather_rows, has_fused_gather

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pages(scheme: str, dc: int, dr: int, group: int, nb: int = 6, bs: int = 32, seed: int = 0, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    lay = RecordLayout(scheme, dc, dr, group)
    if pad:  # records padded (a per-layer codec's engine pages every layer at the largest record)
        lay = RecordLayout(scheme, dc, dr, group, pad_to=lay.record_bytes + pad)
    pages = torch.zeros(nb, bs, lay.record_bytes, dtype=torch.uint8, device=DEV)
    slots = torch.randperm(nb * bs, generator=g)[: nb * bs // 2].to(DEV)
    c = (torch.randn(slots.numel(), dc, generator=g) * 3).to(DEV)
    r = (torch.randn(slots.numel(), dr, generator=g) * 3).to(DEV)
    lay.write_pages(pages, slots, c, r)
    return lay, pages, slots, g


@pytest.mark.parametrize(("scheme", "dc", "dr", "group", "pad"), [
    ("c4r4", 128, 64, 64, 0), ("c2r4", 128, 64, 32, 0), ("c4r4", 512, 64, 64, 0), ("bf16", 128, 64, 64, 0),
    ("c2r4", 128, 64, 64, 144), ("bf16", 128, 64, 64, 48)])  # fmt: skip
def test_the_fused_gather_equals_the_torch_read(scheme, dc, dr, group, pad):
    lay, pages, slots, g = _pages(scheme, dc, dr, group, pad=pad)
    pick = slots[torch.randint(slots.numel(), (40,), generator=g).to(DEV)]
    got = torch.empty(40, dc + dr, dtype=torch.bfloat16, device=DEV)
    gather_rows(lay, pages, pick, got)
    c, r = lay.unpack(lay.read_slots(pages, pick), torch.float32)
    want = torch.cat([c, r], -1).bfloat16()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got.float().abs().sum() > 0


def test_the_fused_gather_reads_the_wanted_tokens_from_their_shadows():
    lay, pages, slots, g = _pages("c4r4", 128, 64, 64)
    d = 192
    nsub = 4
    rows = (torch.randn(nsub * SUB + 1, d, generator=g) * 5).bfloat16().to(DEV)
    smap = torch.full((pages.shape[0] * pages.shape[1] // SUB,), -1, dtype=torch.int32, device=DEV)
    keys = torch.randperm(smap.numel(), generator=g)[:nsub].to(DEV)
    smap[keys] = torch.arange(nsub, dtype=torch.int32, device=DEV)
    pick = slots[torch.randint(slots.numel(), (64,), generator=g).to(DEV)]
    wanted = torch.rand(64, generator=g).to(DEV) < 0.6
    got = torch.empty(64, d, dtype=torch.bfloat16, device=DEV)
    gather_rows(lay, pages, pick, got, wanted=wanted, shadow_rows=rows, shadow_map=smap)
    c, r = lay.unpack(lay.read_slots(pages, pick), torch.float32)
    sh = smap[pick // SUB].long()
    srow = torch.where(sh >= 0, sh * SUB + pick % SUB, rows.shape[0] - 1)
    want = torch.where(wanted[:, None], rows[srow], torch.cat([c, r], -1).bfloat16())
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert bool((wanted & (sh >= 0)).any()) and bool((~wanted).any())


def test_the_fused_gather_covers_the_kernel_schemes_only():
    assert not has_fused_gather(RecordLayout("fp8", 512, 64, 64))
    lay = RecordLayout("c8r8", 128, 64, 64)
    with pytest.raises(ValueError, match="no fused gather"):
        gather_rows(lay, torch.zeros(1, 16, lay.record_bytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, 192, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the GPU's compiled variants (no compiler on the CPU)")
@pytest.mark.parametrize("windows", [False, True])
def test_warm_gather_compiles_the_variant_an_engine_runs(windows):
    """After :func:`warm_gather` (what the vLLM plugin runs at start), a gather of real pages, another row
    count and another pool size compiles nothing more: the first chunked prefill does not wait for Triton."""
    from quantmla.kernels.gather import _gather_kernel, warm_gather

    lay, pages, slots, g = _pages("c4r4", 512, 64, 64)
    warm_gather(lay, pages.shape[1], windows, DEV)
    torch.cuda.synchronize()
    compiled = len(_gather_kernel.device_caches[torch.cuda.current_device()][0])
    shadow = {}
    if windows:
        shadow = dict(wanted=torch.rand(37, generator=g).to(DEV) < 0.5,
                      shadow_rows=torch.zeros(4 * 136 + 1, 576, dtype=torch.bfloat16, device=DEV),
                      shadow_map=torch.full((pages.shape[0] * pages.shape[1] // SUB,), -1, dtype=torch.int32,
                                            device=DEV))  # fmt: skip
    gather_rows(lay, pages, slots[:37], torch.empty(37, 576, dtype=torch.bfloat16, device=DEV), **shadow)
    torch.cuda.synchronize()
    assert len(_gather_kernel.device_caches[torch.cuda.current_device()][0]) == compiled
