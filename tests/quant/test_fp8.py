import torch

from quantmla.formats import parse_scheme
from quantmla.quant import dequantize_fp8, quantize_fp8


def test_power_of_two_scales_and_relative_error():
    x = torch.randn(16, 512) * torch.logspace(-2, 2, 16).unsqueeze(1)
    q = quantize_fp8(x)
    assert q.values.dtype == torch.float8_e4m3fn and q.scale.shape == (16, 4)
    log2 = torch.log2(q.scale)
    assert torch.equal(log2, torch.round(log2))
    assert (q.values.float().abs().amax(-1) <= 448).all()
    x_hat = dequantize_fp8(q.values, q.scale)
    # e4m3: 3 mantissa bits, relative rounding error <= 2^-4 for normal values, absolute
    # error <= half the subnormal spacing (2^-10 * scale) for tiny ones
    tol = torch.maximum(x.abs() * 2**-4, (2**-10) * q.scale.repeat_interleave(128, -1))
    assert ((x - x_hat).abs() <= tol * 1.0001).all()


def test_fp8_scheme_bytes():
    assert parse_scheme("fp8").bytes_per_token(512, 64) == 656
