"""The packing of the kernel layout, and the low-bit kernel's inline PTX run on a small emulator.

The PTX only runs on a GPU; emulating its few instructions (prmt, lop3, shr, mov, sub/fma.f16x2)
bit-exactly here checks the bit tricks on every code and both halves of each register on CPU.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.formats.packing import pack_words, unpack_words
from quantmla.kernels import unpack
from quantmla.kernels.layout import PagedLayout


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(4, 8, 512), (4, 8, 128), (2, 8, 512), (2, 8, 256), (4, 4, 64)]), st.integers(0, 2**31 - 1))
def test_pack_words_round_trip_and_bit_positions(cfg, seed):
    bits, planes, d = cfg
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (3, d), generator=g, dtype=torch.uint8)
    packed = pack_words(codes, bits, planes)
    assert packed.shape == (3, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_words(packed, bits, planes), codes)
    nbytes = planes * bits // 8
    words = sum(packed.long().unflatten(-1, (-1, nbytes))[..., i] << (8 * i) for i in range(nbytes))
    e, k = d // planes - 1, planes - 1  # last word, last plane: channel k * d / planes + e at bit k * bits
    assert torch.equal((words[:, e] >> (bits * k)) & (2**bits - 1), codes[:, k * d // planes + e].long())


def test_layout_rejects_geometry_the_kernel_cannot_cut():
    with pytest.raises(ValueError, match="kv_lora_rank=64"):
        PagedLayout(4, 4, kv_lora_rank=64)
    with pytest.raises(ValueError, match="rope_dim=32"):
        PagedLayout(4, 4, kv_lora_rank=128, rope_dim=32, group_size=32)
    with pytest.raises(ValueError, match="words must be"):
        pack_words(torch.zeros(2, 64, dtype=torch.uint8), 4, 2)


def _f16x2(lo, hi):
    return int(np.array([lo, hi], np.float16).view(np.uint32)[0])


def _halves(r):
    return np.array([r], np.uint32).view(np.float16).astype(np.float64)


def emulate(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Run the PTX subset the kernel uses; registers are 32-bit ints, ``$i`` the operands."""
    reg = {f"${i}": v for i, v in operands.items()}

    def val(x):
        x = x.strip().rstrip(";")
        return int(x, 0) if x[0].isdigit() else reg[x]

    for line in asm.splitlines():
        line = line.strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.rstrip(";").split(",")]
        d = a[0]
        if op == "prmt.b32":
            src = val(a[1]) | (val(a[2]) << 32)
            sel = val(a[3])
            reg[d] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 255) << (8 * i) for i in range(4))
        elif op == "lop3.b32":
            assert val(a[4]) == 0xEA  # (a & b) | c
            reg[d] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "shr.b32":
            reg[d] = val(a[1]) >> val(a[2])
        elif op == "mov.b32" and d.startswith("{"):  # split a register into two 16-bit halves
            lo, hi = d.strip("{ "), a[1].strip("} ")
            v = val(a[2])
            reg[lo], reg[hi] = v & 0xFFFF, v >> 16
        elif op == "mov.b32" and a[1].startswith("{"):  # join two 16-bit registers
            reg[d] = val(a[1].strip("{ ")) | (val(a[2].strip("} ")) << 16)
        elif op == "mov.b32":
            reg[d] = val(a[1])
        elif op == "sub.f16x2":  # exact here (integers below 2048)
            x, y = _halves(val(a[1])), _halves(val(a[2]))
            reg[d] = _f16x2(*(x - y))
        elif op == "fma.rn.f16x2":  # float64 is exact for code * fp16 + fp16: one rounding, as fma
            x, y, z = _halves(val(a[1])), _halves(val(a[2])), _halves(val(a[3]))
            reg[d] = _f16x2(*(x * y + z))
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return reg


# the PTX strings the kernels inline: (asm, constraints, word bits, code bits, planes, one shared scale word)
KERNEL_ASM = {
    "content-int4": (unpack.C4_ASM, unpack.C4_CONS, 32, 4, 8, False),
    "content-int2": (unpack.C2_ASM, unpack.C2_CONS, 16, 2, 8, False),
    "rope-int4-one-group": (unpack.R4_ASM, unpack.R4_CONS, 16, 4, 4, True),
    "rope-int4-per-plane": (unpack.R4P_ASM, unpack.R4P_CONS, 16, 4, 4, False),
}


@pytest.mark.parametrize("name", list(KERNEL_ASM))
def test_ptx_dequantises_every_code_of_both_words(name):
    """Two words per call; output plane k is (code k of word 0, code k of word 1) * s_k + m_k, from
    plane k's scale|minimum word (one word for all planes when ``shared``). Each plane gets a different
    scale and minimum, so a plane that read another plane's word would fail."""
    asm, cons, word_bits, bits, planes, shared = KERNEL_ASM[name]
    asm, cons = asm.value, cons.value
    n_words = 2 if word_bits == 32 else 1
    n_sm = 1 if shared else planes
    assert cons.split(",") == ["=r"] * planes + ["r"] * (n_words + 2 * n_sm)
    rng = np.random.default_rng(0)
    for trial in range(200):
        codes = rng.integers(0, 2**bits, size=(2, planes)) if trial else np.full((2, planes), 2**bits - 1)
        words = [sum(int(c) << (bits * k) for k, c in enumerate(codes[e])) for e in range(2)]
        s = rng.uniform(0.01, 40, planes).astype(np.float16)
        m = rng.uniform(-300, 300, planes).astype(np.float16)
        ops = dict(enumerate([0] * planes))
        if n_words == 2:
            ops[planes], ops[planes + 1] = words
        else:
            ops[planes] = words[0] | (words[1] << 16)
        first = planes + n_words
        for k in range(n_sm):  # scale|minimum words; the second register of each is unused
            ops[first + 2 * k], ops[first + 2 * k + 1] = _f16x2(s[k], m[k]), 0xDEADBEEF
        out = emulate(asm, ops)
        for k in range(planes):
            sk, mk = (s[0], m[0]) if shared else (s[k], m[k])
            got = _halves(out[f"${k}"] & 0xFFFFFFFF)
            want = (codes[:, k] * sk.astype(np.float64) + mk.astype(np.float64)).astype(np.float16)
            assert np.array_equal(got, want.astype(np.float64)), (trial, k, got, want)


@pytest.mark.parametrize("bits", [2, 4])
def test_magic_exponent_turns_every_code_at_every_position_into_its_integer(bits):
    """The lop3 trick of :func:`code_lines` (mask a code into a half's mantissa, OR in the exponent of
    ``2**(10 - p)``, subtract it) and the shift for codes past the 10-bit mantissa, emulated: every code
    value at every position of both 16-bit halves comes out as its integer (scale 1, minimum 0)."""
    n = 16 // bits  # codes per half: 4 INT4, 8 INT2
    outs = [f"o{i}" for i in range(n)]
    lines = unpack.code_lines("$0", range(n), bits, outs, ["s"] * n, ["m"] * n)
    one, zero = _f16x2(1.0, 1.0), _f16x2(0.0, 0.0)
    asm = "\n".join([f"mov.b32 s, {one};", f"mov.b32 m, {zero};", *lines])
    for v in range(2**bits):
        lo, hi = v, 2**bits - 1 - v  # every position holds v in the low half, its complement in the high
        word = sum(lo << (bits * k) for k in range(n)) | sum(hi << (bits * k) for k in range(n)) << 16
        reg = emulate(asm, {0: word})
        for k in range(n):
            assert np.array_equal(_halves(reg[outs[k]]), [lo, hi]), (bits, v, k, _halves(reg[outs[k]]))
