"""The folded-scale arithmetic of the decode kernel v3 (issue 19, ``METHOD.md`` section 8), in torch.

v3 never materialises the dequantised tile ``x = u * s + m``: the codes go to the tensor cores as they come
out of the magic conversion, ``U = 1024 + u`` (an ``lop3`` that ORs the code into the mantissa of fp16
``0x6400``, exact for codes below 1024; with bf16 operands ``0x4300``, ``128 + u``), and each group's scale and
minimum are applied outside the products. For token ``t``, group ``g`` (``group`` channels), scale ``s_g[t]``
and minimum ``m_g[t]``, with the folded minimum ``m'_g[t] = m_g[t] - 1024 * s_g[t]``:

* scores (tokens on M, heads on N):
  ``S^T[t, h] = sum_g s_g[t] * (U_g q_g^T)[t, h] + m'_g[t] * sum_{i in g} q[h, i]``,
  one accumulator per group and one per-head query sum per group (computed once per call);
* output: ``O[h, i] = sum_t U[t, i] * w_g[h, t] + sum_t m_g[t] P[h, t] - 1024 * sum_t w_g[h, t]`` for ``i`` in
  ``g``, with ``w_g = s_g o P`` *as rounded to the MMA operand*: a product with the scaled probabilities plus a
  per-(head, group) term broadcast over the group's channels. The 1024 must come off with the rounded operand's
  own sum (one extra reduction of what the kernel just wrote): folded into ``m'`` with the exact ``s o P``, the
  operand's rounding comes back multiplied by the magic number (in the test's case 73x the error with fp16
  operands, 9.5x with bf16; taken off the rounded sum, the folded output is more precise than a dequantised tile
  rounded to the operand type, since the codes stay exact).

These functions compute exactly that, with the kernel's rounding points as options: the MMA operands rounded to
``operand_dtype`` (the query, and ``s_g o P``; ``U`` is exact in fp16) and the products accumulated in
``accum_dtype``. In float64 they equal the dequantised products to rounding (``tests/kernels/test_folded.py``);
with fp16 operands and fp32 accumulators they show what the fold costs in the scores: the ``1024 * s`` carried
inside each group accumulator and cancelled by ``m'`` costs accumulator bits (in the test's cases 21-29x the error
of the unfolded fp32 product, ~2e-6 of the scores' scale, still far below a bf16 operand's 2**-8).
"""

from __future__ import annotations

import torch

#: per MMA operand type, the magic bit pattern of the code conversion and its value: OR-ing a code below the
#: value into the mantissa gives value + code exactly (fp16 0x6400 = 1024.0, 10 mantissa bits; bf16 0x4300 =
#: 128.0, 7 bits). Wider types (the float64 reference) use fp16's.
MAGICS = {torch.float16: (0x6400, 1024.0), torch.bfloat16: (0x4300, 128.0)}


def magic_number(dtype: torch.dtype) -> float:
    """The value the conversion adds for operands of ``dtype``."""
    return MAGICS.get(dtype, MAGICS[torch.float16])[1]


def magic_codes(codes: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``magic + u`` as the conversion yields it for ``dtype`` operands (exact for codes below the magic)."""
    pattern, value = MAGICS.get(dtype, MAGICS[torch.float16])
    if codes.dtype.is_floating_point or int(codes.min()) < 0 or int(codes.max()) >= value:
        raise ValueError(f"codes must be integers in [0, {value:.0f}) for the {pattern:#06x} conversion")
    half = torch.float16 if pattern == 0x6400 else torch.bfloat16
    return (codes.to(torch.int32) | pattern).to(torch.int16).view(half).to(dtype)


def folded_minimum(
    scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype = torch.float32, magic: float = 1024.0
) -> torch.Tensor:
    """``m' = m - magic * s`` per token and group, in ``dtype`` (the kernel's registers: fp32)."""
    return minimum.to(dtype) - magic * scale.to(dtype)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    *lead, d = x.shape
    if d % group:
        raise ValueError(f"{d} channels are not a whole number of groups of {group}")
    return x.reshape(*lead, d // group, group)


def folded_scores(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    q: torch.Tensor,
    group: int = 64,
    operand_dtype: torch.dtype = torch.float64,
    accum_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``S^T [T, H]`` of the codes ``[T, D]`` (scales and minima ``[T, D / group]``) against the queries
    ``[H, D]``, the kernel's way: per-group products of the magic codes with the query, scaled after."""
    u = _groups(magic_codes(codes, operand_dtype), group)  # [T, G, g]
    qg = _groups(q.to(operand_dtype), group)  # [H, G, g]
    acc = torch.einsum("tgi,hgi->tgh", u.to(accum_dtype), qg.to(accum_dtype))  # one accumulator per group
    qsum = qg.to(accum_dtype).sum(-1)  # [H, G], once per call
    s, mf = scale.to(accum_dtype), folded_minimum(scale, minimum, accum_dtype, magic_number(operand_dtype))
    return (s[..., None] * acc).sum(1) + mf @ qsum.T


def folded_output(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    p: torch.Tensor,
    group: int = 64,
    operand_dtype: torch.dtype = torch.float64,
    accum_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``O [H, D]`` of the probabilities ``[H, T]`` over the codes ``[T, D]``, the kernel's way: each group a
    product of the magic codes with ``s_g o P`` (rounded to the MMA operand type), plus the rank-1 term."""
    u = _groups(magic_codes(codes, operand_dtype), group).to(accum_dtype)  # [T, G, g]
    sp = (p.to(accum_dtype)[:, :, None] * scale.to(accum_dtype)[None]).to(operand_dtype).to(accum_dtype)  # [H, T, G]
    main = torch.einsum("tgi,htg->hgi", u, sp)
    # the 1024 comes off with the *rounded* operand's sum, so it cancels what the product carried; taken from
    # the exact s o P (m' = m - 1024 s) it would leave 1024 x the operand's rounding error in the output
    rank1 = p.to(accum_dtype) @ minimum.to(accum_dtype) - magic_number(operand_dtype) * sp.sum(1)  # [H, G]
    return (main + rank1[..., None]).reshape(p.shape[0], -1)


def dequantised(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int = 64) -> torch.Tensor:
    """``u * s + m`` in float64: the tile v3 never builds, for the references."""
    x = _groups(codes.to(torch.float64), group) * scale.double()[..., None] + minimum.double()[..., None]
    return x.reshape(codes.shape)
