import pytest
import torch

from quantmla.quant import dequantize_per_channel, quantize_per_channel


def test_groups_run_along_tokens():
    x = torch.randn(2, 128, 64)
    x[..., 7] *= 50  # an outlier channel gets its own range
    q = quantize_per_channel(x, 4, page_size=64)
    assert q.scale.shape == (2, 2, 64)
    page = x[:, :64]
    expect = (page.amax(1) - page.amin(1)) / 15
    assert torch.allclose(q.scale[:, 0].float(), expect, rtol=2e-3)
    err = (x - dequantize_per_channel(q)).abs()
    bound = q.scale.float().repeat_interleave(64, dim=1) / 2
    assert (err <= bound + 1e-4).all()
    # the outlier channel does not degrade the others
    assert err[..., :7].max() < err[..., 7].max() / 10


def test_page_must_divide_tokens():
    with pytest.raises(ValueError, match="page_size=64 must divide"):
        quantize_per_channel(torch.randn(100, 64), 4, 64)
