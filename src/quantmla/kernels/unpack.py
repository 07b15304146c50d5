"""Unpack-and-dequantise of group-planar code words into fp16 MMA operands, inside Triton kernels.

A word of ``planes * bits`` bits holds one code of each of ``planes`` planes (the packing of
:func:`quantmla.formats.packing.pack_words`); each plane is a run of channels inside one quantisation
group, so a plane of a token tile has one scale and one minimum per token.

On the GPU one inline-PTX call turns two words into one ``f16x2`` register per plane, without any
int-to-float conversion instruction (those run at 1/8 of the FMA rate and were the bottleneck):

* ``lop3``: mask the code into a half's mantissa and OR in an exponent, giving ``M + code`` exactly
  (``M = 2**(10 - p)`` for a code at mantissa bit ``p``);
* ``sub.f16x2``: ``- M``, exact, giving the code as an fp16 integer;
* ``fma.rn.f16x2``: ``code * scale + minimum`` with the fp16 scale and minimum, rounded once; the
  scale and minimum come straight from the token's int32 scale|minimum word through the
  instruction's half selectors (``.H0_H0``, ``.H1_H1``), at no instruction.

That is 1.5 instructions per value plus one shift (and for 32-bit words one byte permute) per
word pair. Under ``TRITON_INTERPRET=1`` (CPU tests) the same values come from plain shifts and
float32 arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _half_magic(bit: int) -> int:
    """fp16 bits of ``2**(10 - bit)``: OR-ing a code at mantissa bit ``bit`` gives ``2**(10-bit) + code``."""
    return (25 - bit) << 10


def code_lines(src: str, codes: range, bits: int, outs: list[str], scales: list[str], mins: list[str]) -> list[str]:
    """PTX that turns codes ``codes`` of each 16-bit half of register ``src`` (code ``j`` at bit
    ``j * bits``) into ``f16x2`` registers ``outs``: ``lop3`` (mask + exponent), ``sub.f16x2`` (exact),
    ``fma.rn.f16x2`` with ``scales[i]`` / ``mins[i]``. Uses scratch registers ``v`` and ``c``."""
    lines, shifted, base = [], src, 0
    for i, j in enumerate(codes):
        bit = j * bits - base
        if bit + bits > 10:  # leave the mantissa: shift the rest of the half down
            lines.append(f"shr.b32 v, {src}, {j * bits};")
            shifted, base, bit = "v", j * bits, 0
        mask = ((1 << bits) - 1) << bit
        magic = _half_magic(bit)
        lines += [
            f"lop3.b32 {outs[i]}, {shifted}, {mask | mask << 16:#010x}, {magic | magic << 16:#010x}, 0xea;",
            f"mov.b32 c, {magic | magic << 16:#010x};",
            f"sub.f16x2 {outs[i]}, {outs[i]}, c;",
            f"fma.rn.f16x2 {outs[i]}, {outs[i]}, {scales[i]}, {mins[i]};",
        ]
    return lines


def scale_split_lines(sm: str, s: str, m: str) -> list[str]:
    """PTX: ``(s, s)`` and ``(m, m)`` from a scale|minimum word (fp16 scale low, minimum high). ptxas
    folds the two broadcasts into the ``fma.rn.f16x2`` operand selectors (``.H0_H0``, ``.H1_H1``), so
    they cost no instruction (a ``prmt`` pair per token and plane did before)."""
    return [f"mov.b32 {{sl, mh}}, {sm};", f"mov.b32 {s}, {{sl, sl}};", f"mov.b32 {m}, {{mh, mh}};"]


def _plane_asm(word_bits: int, bits: int, planes: int, shared_scale: bool = False) -> str:
    """PTX for one call: inputs two words and, per plane, its int32 scale|minimum word (with
    ``pack=2`` each arrives as two registers holding the same value, as both words of a pair lie in
    one token row; ``shared_scale``: one word for all planes); outputs one ``f16x2`` per plane.
    Operand numbering: outputs ``$0..$(P-1)``, the word register(s), then the scale word registers."""
    P = planes
    S = 1 if shared_scale else P  # scale|minimum words
    lines = ["{", f".reg .b32 hw<2>, v, c, s<{S}>, m<{S}>;", ".reg .b16 sl, mh;"]
    if word_bits == 32:  # two 32-bit words: gather their low and high halves into two registers
        w0, w1 = f"${P}", f"${P + 1}"
        lines += [f"prmt.b32 hw0, {w0}, {w1}, 0x5410;", f"prmt.b32 hw1, {w0}, {w1}, 0x7632;"]
        sources = ["hw0", "hw1"]
        first_sm = P + 2
    else:  # two 16-bit words arrive packed in one register
        sources = [f"${P}"]
        first_sm = P + 1
    for k in range(S):
        lines += scale_split_lines(f"${first_sm + 2 * k}", f"s{k}", f"m{k}")
    per_half = 16 // bits  # codes of one word-half
    for h, src in enumerate(sources):
        ks = range(h * per_half, (h + 1) * per_half)
        lines += code_lines(src, range(per_half), bits, [f"${k}" for k in ks], [f"s{k % S}" for k in ks],
                            [f"m{k % S}" for k in ks])  # fmt: skip
    assert len(sources) * per_half == P, (len(sources) * per_half, P)
    lines.append("}")
    return "\n".join(lines)


def plane_asm_kernel_args(word_bits: int, bits: int, planes: int, shared_scale: bool = False) -> tuple[str, str]:
    asm = _plane_asm(word_bits, bits, planes, shared_scale)
    n_words = 2 if word_bits == 32 else 1
    constraints = ",".join(["=r"] * planes + ["r"] * (n_words + 2 * (1 if shared_scale else planes)))
    return asm, constraints


_C4 = plane_asm_kernel_args(32, 4, 8)  # INT4 content: 8 planes in a 32-bit word
_C2 = plane_asm_kernel_args(16, 2, 8)  # INT2 content: 8 planes in a 16-bit word
_R4 = plane_asm_kernel_args(16, 4, 4, shared_scale=True)  # INT4 RoPE key, one group: one scale word
_R4P = plane_asm_kernel_args(16, 4, 4)  # INT4 RoPE key over several groups: a scale word per plane
C4_ASM, C4_CONS = tl.constexpr(_C4[0]), tl.constexpr(_C4[1])
C2_ASM, C2_CONS = tl.constexpr(_C2[0]), tl.constexpr(_C2[1])
R4_ASM, R4_CONS = tl.constexpr(_R4[0]), tl.constexpr(_R4[1])
R4P_ASM, R4P_CONS = tl.constexpr(_R4P[0]), tl.constexpr(_R4P[1])


@triton.jit
def _plane_ref(w, sm, k: tl.constexpr, BITS: tl.constexpr):
    x = ((w >> (BITS * k)) & ((1 << BITS) - 1)).to(tl.float32)
    s = (sm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    m = ((sm >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (x * s + m).to(tl.float16)


@triton.jit
def dequant8(w, sm0, sm1, sm2, sm3, sm4, sm5, sm6, sm7, BITS: tl.constexpr, WORD: tl.constexpr, ASM_OK: tl.constexpr):
    """Eight planes of a content tile: ``w [T, n]`` words; per plane the scale|minimum word ``[T, 1]`` int32."""
    if ASM_OK:
        if WORD == 32:
            return tl.inline_asm_elementwise(
                C4_ASM, C4_CONS, [w, sm0, sm1, sm2, sm3, sm4, sm5, sm6, sm7], dtype=(tl.float16,) * 8,
                is_pure=False, pack=2,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            C2_ASM, C2_CONS, [w, sm0, sm1, sm2, sm3, sm4, sm5, sm6, sm7], dtype=(tl.float16,) * 8,
            is_pure=False, pack=2,
        )  # fmt: skip
    else:
        return (
            _plane_ref(w, sm0, 0, BITS), _plane_ref(w, sm1, 1, BITS), _plane_ref(w, sm2, 2, BITS),
            _plane_ref(w, sm3, 3, BITS), _plane_ref(w, sm4, 4, BITS), _plane_ref(w, sm5, 5, BITS),
            _plane_ref(w, sm6, 6, BITS), _plane_ref(w, sm7, 7, BITS),
        )  # fmt: skip


@triton.jit
def dequant4(w, sm0, sm1, sm2, sm3, SHARED: tl.constexpr, ASM_OK: tl.constexpr):
    """Four INT4 planes of a RoPE tile: ``w [T, n]`` 16-bit words; per plane the scale|minimum word
    ``[T, 1]``. ``SHARED``: one group covers the key, so ``sm0`` serves every plane (one scale word)."""
    if ASM_OK:
        if SHARED:
            return tl.inline_asm_elementwise(
                R4_ASM, R4_CONS, [w, sm0], dtype=(tl.float16,) * 4, is_pure=False, pack=2
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            R4P_ASM, R4P_CONS, [w, sm0, sm1, sm2, sm3], dtype=(tl.float16,) * 4, is_pure=False, pack=2
        )  # fmt: skip
    else:
        if SHARED:
            return (_plane_ref(w, sm0, 0, 4), _plane_ref(w, sm0, 1, 4), _plane_ref(w, sm0, 2, 4),
                    _plane_ref(w, sm0, 3, 4))  # fmt: skip
        return (_plane_ref(w, sm0, 0, 4), _plane_ref(w, sm1, 1, 4), _plane_ref(w, sm2, 2, 4),
                _plane_ref(w, sm3, 3, 4))  # fmt: skip
