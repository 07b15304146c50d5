"""The fused cache write equals the torch write path byte for byte (CPU: Triton's interpreter)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional dependency")
from quantmla.formats.records import RecordLayout  # noqa: E402
from quantmla.kernels.write import write_records  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tokens(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=g) * torch.logspace(-6, 3, n)[:, None]  # tiny to large magnitudes
    x[0] = 1.5  # a constant group: scale 0, codes 0
    x[1, :64] = -0.0
    x[2] *= 1e-30  # below fp16's smallest subnormal
    x[3, 5] = -7e4  # beyond fp16: the minimum clamps to -65504
    return x


@pytest.mark.parametrize(("scheme", "group"), [("c4r4", 64), ("c2r4", 64), ("c4r4", 32), ("c2r4", 16), ("bf16", 64)])
@pytest.mark.parametrize(("block_size", "pad"), [(16, 0), (64, 0), (16, 144)])
def test_fused_write_equals_the_torch_write_byte_for_byte(scheme, group, block_size, pad):
    """``pad``: records padded (a per-layer codec's engine pages every layer at the largest record)."""
    g = torch.Generator().manual_seed(7)
    lay = RecordLayout(scheme, 512, 64, group)
    if pad:
        lay = RecordLayout(scheme, 512, 64, group, pad_to=lay.record_bytes + pad)
    n, blocks = 24, 4
    wide = _tokens(n, 600, g)  # strided rows, as vLLM passes its latent
    c, r = wide[:, :512], _tokens(n, 64, g)
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    slots[5] = -1  # padding: skipped
    base = torch.randint(0, 256, (blocks, block_size, lay.record_bytes), generator=g, dtype=torch.uint8)
    want = base.clone()
    keep = slots >= 0
    lay.write_pages(want, slots[keep], c[keep], r[keep])
    got = base.clone().to(DEV)
    write_records(lay, got, slots.to(DEV), c.to(DEV), r.to(DEV))
    assert torch.equal(got.cpu(), want)


def test_schemes_without_a_fused_write_say_so():
    lay = RecordLayout("c8r8")
    with pytest.raises(ValueError, match="valid: bf16, c4r4, c2r4"):
        write_records(lay, torch.zeros(1, 16, lay.record_bytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.long),
                      torch.zeros(1, 512), torch.zeros(1, 64))  # fmt: skip
