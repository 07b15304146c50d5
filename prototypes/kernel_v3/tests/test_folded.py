"""The decode kernel v3's folded-scale arithmetic (issue 19), against the dequantised products in float64."""

from __future__ import annotations

import pytest
import torch
from kernel_v3.folded import (
    dequantised,
    folded_minimum,
    folded_output,
    folded_scores,
    magic_codes,
    magic_number,
)

U32 = 2.0**-24  # unit roundoff of fp32


def _case(bits: int, group: int, seed: int, tokens: int = 67, dim: int = 256, heads: int = 16):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (tokens, dim), generator=gen)
    scale = (torch.rand(tokens, dim // group, generator=gen) * 0.2 + 1e-3).half()
    minimum = (torch.randn(tokens, dim // group, generator=gen) * 2).half()
    q = (torch.randn(heads, dim, generator=gen) * 3).half()  # the kernel's query operand
    p = torch.softmax(torch.randn(heads, tokens, generator=gen, dtype=torch.float64) * 3, -1)
    return codes, scale, minimum, q, p


def test_magic_codes_are_exact_and_checked():
    u = torch.arange(1024)
    assert torch.equal(magic_codes(u).double(), 1024.0 + u.double())  # every code the conversion can carry
    assert magic_codes(torch.tensor([5])).view(torch.int16).item() == 0x6405  # the lop3 result: 0x6400 | code
    for bad in (torch.tensor([-1]), torch.tensor([1024]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="0x6400"):
            magic_codes(bad)
    u = torch.arange(128)  # bf16 operands: 0x4300 = 128, 7 mantissa bits
    assert torch.equal(magic_codes(u, torch.bfloat16).double(), 128.0 + u.double())
    with pytest.raises(ValueError, match="0x4300"):
        magic_codes(torch.tensor([128]), torch.bfloat16)


@pytest.mark.parametrize("bits,group,seed", [(4, 64, 0), (2, 64, 1), (4, 32, 2), (2, 128, 3), (4, 128, 4)])
def test_folded_products_equal_the_dequantised_ones_in_float64(bits, group, seed):
    codes, scale, minimum, q, p = _case(bits, group, seed)
    x = dequantised(codes, scale, minimum, group)
    want_s, want_o = x @ q.double().T, p @ x
    got_s = folded_scores(codes, scale, minimum, q, group)
    got_o = folded_output(codes, scale, minimum, p, group)
    assert (got_s - want_s).abs().max().item() <= 1e-9 * want_s.abs().max().item()
    assert (got_o - want_o).abs().max().item() <= 1e-9 * want_o.abs().max().item()
    # the folded minimum carries the magic number's 1024: without it the identity breaks
    wrong = folded_scores(codes, scale, scale * 0 + minimum, q, group) + 1024 * (scale.double() @ _qsum(q, group).T)
    assert (wrong - want_s).abs().max().item() > 1.0
    assert torch.equal(folded_minimum(scale, minimum), minimum.float() - 1024 * scale.float())


def _qsum(q: torch.Tensor, group: int) -> torch.Tensor:
    return q.double().reshape(q.shape[0], -1, group).sum(-1)


@pytest.mark.parametrize("bits,seed", [(4, 5), (2, 6)])
def test_fp16_operands_fp32_accumulators_stay_within_the_rounding_bound(bits, seed):
    # the kernel's precision: fp16 operands (U exact, q given in fp16), fp32 accumulators. Standard bound of a
    # sum of n products in fp32: n * u * sum |a b|; the group accumulators hold (1024 + u) q, so the bound
    # scales with |U|, not |u|, plus the folded minimum's term and the final sum over groups
    group = 64
    codes, scale, minimum, q, _ = _case(bits, group, seed)
    x = dequantised(codes, scale, minimum, group)
    want = x @ q.double().T
    got = folded_scores(codes, scale, minimum, q, group, torch.float16, torch.float32).double()
    big_u = magic_codes(codes, torch.float64).reshape(codes.shape[0], -1, group)
    qa = q.double().abs().reshape(q.shape[0], -1, group)
    acc_mag = torch.einsum("tgi,hgi->tgh", big_u, qa)  # sum |U q| per group
    mf = (minimum.double() - 1024 * scale.double()).abs()
    n = group + codes.shape[1] // group + 2
    bound = n * U32 * ((scale.double()[..., None] * acc_mag).sum(1) + mf @ qa.sum(-1).T)
    err = (got - want).abs()
    assert bool((err <= bound).all())
    # what the fold costs: the unfolded products (the dequantised tile in fp32) are far more precise; the fold
    # leaves the scores ~2**-14 of their scale, still finer than a bf16 operand's 2**-8
    plain = (x.float() @ q.float().T).double()
    assert err.max().item() > 8 * (plain - want).abs().max().item()
    assert err.max().item() <= 2**-14 * (x.abs() @ q.double().abs().T).max().item()


@pytest.mark.parametrize("operand", [torch.float16, torch.bfloat16])
def test_output_with_rounded_scaled_probabilities_stays_within_the_rounding_bound(operand):
    # O's operand is w = s_g o P rounded to the MMA type (round to nearest: fp16 relative 2**-11 and absolute
    # 2**-25 where subnormal; bf16 2**-8); the codes U are exact; fp32 accumulators. With the 1024 taken off
    # the rounded operand's sum, the operand's rounding reaches the output weighted by the codes u, not by U
    group = 64
    codes, scale, minimum, _, p = _case(4, group, 7)
    x = dequantised(codes, scale, minimum, group)
    want = p @ x
    got = folded_output(codes, scale, minimum, p, group, operand, torch.float32).double()
    rel, absolute = (2.0**-11, 2.0**-25) if operand == torch.float16 else (2.0**-8, 0.0)
    magic = magic_number(operand)
    u, big_u = codes.double(), magic_codes(codes, operand).double()
    w = (p[:, :, None] * scale.double()[None]).repeat_interleave(group, dim=-1)  # [H, T, D]
    t = codes.shape[0]
    rounding = torch.einsum("hti,ti->hi", rel * w + absolute, u)
    accumulation = (
        (t + 2)
        * U32
        * (
            torch.einsum("hti,ti->hi", w * (1 + rel) + absolute, big_u)
            + p @ minimum.double().abs().repeat_interleave(group, dim=-1)
            + magic * (w * (1 + rel) + absolute).sum(1)
        )
    )
    err = (got - want).abs()
    assert bool((err <= rounding + accumulation).all())
    # the fold through m' = m - magic s with the exact s o P leaves magic x the operand's rounding in O
    w_hat = (p[:, :, None] * scale.double()[None]).to(operand).double()  # [H, T, G]
    main = torch.einsum("tgi,htg->hgi", big_u.reshape(t, -1, group), w_hat)
    naive = (main + (p @ (minimum.double() - magic * scale.double()))[..., None]).reshape(p.shape[0], -1)
    assert (naive - want).abs().max().item() > 5 * err.max().item()  # measured: 73x (fp16), 9.5x (bf16)
    # and the folded form beats the dequantised tile rounded to the same operand type (codes stay exact)
    tile = (p.to(operand).float() @ x.to(operand).float()).double()
    assert err.max().item() < (tile - want).abs().max().item()
