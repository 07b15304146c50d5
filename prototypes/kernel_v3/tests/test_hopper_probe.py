"""The Hopper extension's build guard (CPU) and the fragment probe on the tensor cores (H200): the v3 register
operands built by the kernel's instructions from the fragment-ordered words, times a matrix, equal the tiles of
``magic + code`` (and their transposes) times it, computed in float64 from the codes themselves."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from kernel_v3.fragment import TILE, pack_fragments
from kernel_v3.hopper import HopperUnavailable, extension, missing

MISSING = missing()


def test_unavailable_names_what_is_missing():
    if MISSING is None:
        pytest.skip("this machine has what the Hopper extensions need")
    with pytest.raises(HopperUnavailable, match="need") as err:
        extension("v3")
    assert MISSING in str(err.value)
    with pytest.raises(ValueError, match="valid: v3"):
        extension("nope")


def test_variant_3_refuses_a_warp_count_it_has_no_kernel_for():
    # checked before the extension is built, so on any machine
    from kernel_v3.hopper.tile import stream_h16_cs

    t = torch.zeros(32, 8)
    args = torch.zeros(2, 32, 32, dtype=torch.int32), t, t, torch.zeros(16, 512), torch.zeros(32, 16), 32
    with pytest.raises(ValueError, match=r"warps=6 .*valid: 4, 8"):
        stream_h16_cs(*args, warps=6)
    with pytest.raises(ValueError, match=r"warps=8 .*valid: 4"):
        stream_h16_cs(*args, warps=8, schedule="wgmma-output")
    with pytest.raises(ValueError, match=r"schedule='skew' .*valid: plain, wgmma-output, skewed, skewed-split, plain-"):
        stream_h16_cs(*args, schedule="skew")


@pytest.mark.gpu
@pytest.mark.skipif(MISSING is not None, reason=f"Hopper extensions unavailable: {MISSING}")
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("output", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragment_probe_on_the_tensor_cores(bits, output, dtype):
    from kernel_v3.hopper.probe import fragment_probe

    gen = torch.Generator().manual_seed(bits * 10 + int(output))
    tokens, dim = 32, 128
    codes = torch.randint(0, 2**bits, (tokens, dim), generator=gen)
    b = torch.randn(TILE, TILE, generator=gen).to(dtype)
    got = fragment_probe(pack_fragments(codes, bits), b, bits, output, dtype).double().cpu()
    magic = 1024.0 if dtype == torch.float16 else 128.0
    tiles = (codes.double() + magic).reshape(tokens // TILE, TILE, dim // TILE, TILE).permute(0, 2, 1, 3)
    if output:
        tiles = tiles.transpose(-1, -2)
    want = (tiles @ b.double()).reshape(-1, TILE, TILE)
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item())


def _h16_inputs(seed: int, tokens: int = 256):
    """INT4 codes [T, 512], fp16 scale and minimum [T, 8] (groups of 64), queries [16, 512], probabilities [16, T]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (tokens, 512), generator=gen)
    scale = (torch.rand(tokens, 8, generator=gen) * 0.2 + 1e-3).half()
    minimum = (torch.randn(tokens, 8, generator=gen) * 2).half()
    q = torch.randn(16, 512, generator=gen).half()
    p = torch.softmax(torch.randn(16, tokens, generator=gen) * 3, -1).half()
    return codes, scale, minimum, q, p


@pytest.mark.gpu
@pytest.mark.skipif(MISSING is not None, reason=f"Hopper extensions unavailable: {MISSING}")
@pytest.mark.parametrize("kernel", ["tile", "stream", "stream-v1"])
@pytest.mark.parametrize("per_cta", [64, 128, 256])
def test_h16_prototypes_against_float64(kernel, per_cta):
    # the h = 16 prototypes: scores and output of INT4 codes in groups of 64 against the dequantised products in
    # float64, and against the folded arithmetic emulated with the kernel's rounding points; 256 tokens a CTA are
    # four steps, one more than the pipelined kernel's stages (its ring of copies wraps)
    from kernel_v3.folded import dequantised, folded_output, folded_scores
    from kernel_v3.hopper.tile import pack_h16, stream_h16, tile_h16

    codes, scale, minimum, q, p = _h16_inputs(seed=7)
    dev = torch.device("cuda")
    args = pack_h16(codes).to(dev), scale.to(dev), minimum.to(dev), q.to(dev)
    if kernel == "tile":
        scores, out = tile_h16(*args, p.to(dev), per_cta)
    else:
        variant = int(kernel == "stream-v1")
        scores, out = stream_h16(*args, p.T.contiguous().to(dev), per_cta, variant=variant)
        no_scores, same_out = stream_h16(*args, p.T.contiguous().to(dev), per_cta, write_scores=False, variant=variant)
        assert no_scores.shape == (0, 16) and torch.equal(same_out, out)  # deterministic: no atomics
    x = dequantised(codes, scale, minimum, 64)
    s_ref, o_ref = x @ q.double().T, p.double() @ x
    s_emu = folded_scores(codes, scale, minimum, q, 64, torch.float16, torch.float32).double()
    o_emu = folded_output(codes, scale, minimum, p.double(), 64, torch.float16, torch.float32).double()
    scores, out = scores.double().cpu(), out.double().cpu()
    assert torch.allclose(scores, s_ref, rtol=0, atol=1e-4 * s_ref.abs().max().item())
    assert torch.allclose(scores, s_emu, rtol=0, atol=1e-4 * s_ref.abs().max().item())
    # bounds set before the first GPU run, from the arithmetic: scores carry 1024 x the codes in fp32 group
    # accumulators (the emulation measured ~2e-6 of the scale, tests/kernels/test_folded.py); the output's 1024
    # term cancels over 256 tokens in fp32 (worst case ~256 x 2^-24 x 100 absolute, ~3e-4 of the scale) and
    # s o P is rounded to fp16 (2^-11 relative) against float64
    assert torch.allclose(out, o_emu, rtol=0, atol=5e-4 * o_ref.abs().max().item())
    assert torch.allclose(out, o_ref, rtol=0, atol=2e-3 * o_ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(MISSING is not None, reason=f"Hopper extensions unavailable: {MISSING}")
@pytest.mark.parametrize(
    "kernel", ["stream-v2", "stream-v3", "stream-v3s", "stream-v3w8", "stream-v4", "stream-v5", "stream-v5s"]
)
@pytest.mark.parametrize("per_cta", [32, 64, 96, 256])
def test_h16_prototype_dequantised_in_registers_against_float64(kernel, per_cta):
    # variants 2 and 3 round x = u s + m to fp16 once (HFMA2) and multiply it exactly in fp32: elementwise, the
    # error is at most fp16's unit roundoff 2^-11 of sum |x| |q| (scores) and of P |x| (output), doubled for the
    # fp32 accumulation, plus fp16's subnormal spacing; a missing 1/16 on tokens 8-15, a lost minimum or a wrong
    # transpose (variant 3) is far outside. Variant 3 steps 32 tokens: 96 tokens a CTA leave a last CTA of 64
    # (256 tokens), 256 wrap its ring of three stages
    from kernel_v3.folded import dequantised
    from kernel_v3.hopper.tile import pack_h16, stream_h16_cs, stream_h16_dq

    if kernel == "stream-v2" and per_cta % 64:
        pytest.skip("variant 2 steps 64 tokens")
    runs = {"stream-v2": stream_h16_dq, "stream-v3": stream_h16_cs,
            "stream-v3s": partial(stream_h16_cs, schedule="plain-split"),
            "stream-v3w8": partial(stream_h16_cs, warps=8),
            "stream-v4": partial(stream_h16_cs, schedule="wgmma-output"),
            "stream-v5": partial(stream_h16_cs, schedule="skewed"),
            "stream-v5s": partial(stream_h16_cs, schedule="skewed-split")}  # fmt: skip
    run = runs[kernel]
    codes, scale, minimum, q, p = _h16_inputs(seed=11)
    dev = torch.device("cuda")
    args = pack_h16(codes).to(dev), scale.to(dev), minimum.to(dev), q.to(dev), p.T.contiguous().to(dev)
    scores, out = run(*args, per_cta)
    no_scores, same_out = run(*args, per_cta, write_scores=False)
    assert no_scores.shape == (0, 16) and torch.equal(same_out, out)
    x = dequantised(codes, scale, minimum, 64)
    s_ref, o_ref = x @ q.double().T, p.double() @ x
    s_tol = 2.0**-10 * (x.abs() @ q.double().abs().T) + 2.0**-24 * q.double().abs().sum(-1)
    o_tol = 2.0**-10 * (p.double() @ x.abs()) + 2.0**-24
    assert ((scores.double().cpu() - s_ref).abs() <= s_tol).all()
    assert ((out.double().cpu() - o_ref).abs() <= o_tol).all()
