"""The experimental sliced decode kernel (benchmarks/decode_variants.py) against the torch reference,
under Triton's interpreter on CPU (its PTX half is checked on a CPU emulator and, on the GPU, against
the library kernel by the script itself)."""

import math
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from decode_variants import _sliced_kernel, launch, repack, slice_asm  # noqa: E402

from quantmla.kernels import PagedLatentStore, PagedLayout, mla_decode_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()


def _emulate():
    """The PTX emulator of tests/kernels/test_unpack.py."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "kernels", "test_unpack.py")
    spec = importlib.util.spec_from_file_location("_unpack_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.emulate


@pytest.mark.skipif(ON_GPU, reason="the interpreter path; on the GPU the script checks the compiled kernel")
@pytest.mark.parametrize("bits", [4, 2])
def test_sliced_kernel_matches_reference(bits, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(bits)
    lay = PagedLayout(bits, 4, kv_lora_rank=512, rope_dim=64, page_size=64)
    lens, page = [131, 5], 64
    maxp = 3
    store = PagedLatentStore(lay, len(lens) * maxp + 2)
    for t in store.tensors():  # unused pages: garbage codes and NaN scales, never to be read
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.copy_(torch.randint(0, 256, t.shape, generator=g).to(t.dtype))
    bt = torch.randperm(store.num_pages, generator=g)[: len(lens) * maxp].view(len(lens), maxp).int()
    for b, n in enumerate(lens):
        idx = torch.arange(n)
        c, r = torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g)
        store.write(bt[b, idx // page].long(), idx % page, c, r)
    n_paged = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 16, 512, generator=g).bfloat16()
    qr = torch.randn(len(lens), 16, 64, generator=g).bfloat16()
    scale = 1 / math.sqrt(192)
    o, lse = launch(_sliced_kernel, q, qr, store, repack(store), bt, n_paged, scale, 2, 4, 1)
    o_ref, lse_ref = mla_decode_reference(q, qr, store, bt, n_paged, scale)
    o, o_ref = o.float(), o_ref.float()
    assert torch.nn.functional.cosine_similarity(o.flatten(), o_ref.flatten(), dim=0) > 0.9999
    assert (o - o_ref).abs().max() < 2e-2 * o_ref.abs().max()
    assert torch.allclose(lse, lse_ref.float(), atol=1e-3, rtol=1e-4)


def _f16x2(lo, hi):
    return int(np.array([lo, hi], np.float16).view(np.uint32)[0])


@pytest.mark.parametrize("word_bits,bits,first", [(32, 4, 0), (32, 4, 4), (16, 2, 0), (16, 2, 4), (16, 4, 0)])
def test_slice_asm_uses_each_elements_own_scale(word_bits, bits, first):
    """Every code of both pair elements, each with its own (scale, minimum): the pair may span tokens."""
    count = 1 if (word_bits, bits) == (16, 4) else 4
    asm, cons = slice_asm(word_bits, bits, first, count)
    assert cons.count("=r") == count
    emulate = _emulate()
    rng = np.random.default_rng(word_bits * 10 + bits + first)
    for _ in range(20):
        nw = 2 if word_bits == 32 else 1
        words = [int(x) for x in rng.integers(0, 2**word_bits, 2)]
        (s0, m0), (s1, m1) = rng.uniform(0.01, 2, 2), rng.uniform(-4, 4, 2)
        sm0, sm1 = _f16x2(s0, m0), _f16x2(s1, m1)
        ops = {count + i: w for i, w in enumerate(words if nw == 2 else [words[0] | words[1] << 16])}
        ops.update({count + nw: sm0, count + nw + 1: sm1})
        out = emulate(asm, ops)
        for i in range(count):
            k = first + i
            got = np.array([out[f"${i}"]], np.uint32).view(np.float16).astype(np.float64)
            for e, (w, s, m) in enumerate(((words[0], s0, m0), (words[1], s1, m1))):
                code = (w >> (bits * k)) & ((1 << bits) - 1)
                # fp16 scale and minimum, code * s + m rounded once to fp16 (float64 is exact before it)
                want = float(np.float16(code * float(np.float16(s)) + float(np.float16(m))))
                assert got[e] == want, (k, e, got[e], want)


@pytest.mark.parametrize("word_bits,bits,first,count", [(32, 4, 0, 2), (32, 4, 6, 2), (16, 2, 2, 2), (16, 2, 4, 4)])
def test_planes_asm_uses_each_planes_own_scale(word_bits, bits, first, count):
    """The wgmma kernel's unpack: planes of a word pair of one token, each plane its own (scale, minimum)."""
    pytest.importorskip("triton.experimental.gluon", reason="the wgmma kernel's module imports Gluon")
    from decode_wgmma import planes_asm

    asm, cons = planes_asm(word_bits, bits, first, count)
    assert cons.count("=r") == count
    emulate = _emulate()
    rng = np.random.default_rng(word_bits * 10 + bits + first + count)
    nw = 2 if word_bits == 32 else 1
    for _ in range(20):
        words = [int(x) for x in rng.integers(0, 2**word_bits, 2)]
        s, m = rng.uniform(0.01, 2, count), rng.uniform(-4, 4, count)
        ops = {count + i: w for i, w in enumerate(words if nw == 2 else [words[0] | words[1] << 16])}
        for i in range(count):  # a scale|minimum word per plane, each input as two equal registers (pack=2)
            ops[count + nw + 2 * i] = ops[count + nw + 2 * i + 1] = _f16x2(s[i], m[i])
        out = emulate(asm, ops)
        for i in range(count):
            k = first + i
            got = np.array([out[f"${i}"]], np.uint32).view(np.float16).astype(np.float64)
            for e, w in enumerate(words):
                code = (w >> (bits * k)) & ((1 << bits) - 1)
                want = float(np.float16(code * float(np.float16(s[i])) + float(np.float16(m[i]))))
                assert got[e] == want, (k, e, got[e], want)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels compile for the GPU only (no CPU interpreter)")
@pytest.mark.parametrize("bits", [4, 2])
def test_gluon_sliced_kernel_matches_library_kernel(bits):
    from decode_attention import random_store
    from decode_gluon import _gluon_sliced_kernel

    from quantmla.kernels.decode import mla_decode

    g = torch.Generator(device="cuda").manual_seed(bits)
    store, bt, _ = random_store(f"c{bits}r4", 3, 1000, g)
    n_paged = torch.tensor([1000, 5, 777], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 16, 512, device="cuda", generator=g).bfloat16()
    qr = torch.randn(3, 16, 64, device="cuda", generator=g).bfloat16()
    o_ref, lse_ref = mla_decode(q, qr, store, bt, n_paged, 0.07)
    o, lse = launch(_gluon_sliced_kernel, q, qr, store, repack(store), bt, n_paged, 0.07, 4, 4, 1)
    assert torch.nn.functional.cosine_similarity(o.float().flatten(), o_ref.float().flatten(), dim=0) > 0.9999
    assert torch.allclose(lse, lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels compile for the GPU only (no CPU interpreter)")
@pytest.mark.parametrize("bits", [4, 2])
def test_wgmma_kernel_matches_reference(bits):
    """The transposed warpgroup-MMA kernel (decode_wgmma.py) against the fp32 reference on the
    dequantised cache: awkward lengths, a one-token sequence and splits left without pages."""
    from decode_attention import random_store
    from decode_wgmma import _wgmma_lowbit_kernel

    from quantmla.kernels.reference import mla_decode_reference

    g = torch.Generator(device="cuda").manual_seed(bits)
    store, bt, _ = random_store(f"c{bits}r4", 5, 1000, g)
    n_paged = torch.tensor([1000, 5, 777, 64, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(5, 16, 512, device="cuda", generator=g).bfloat16()
    qr = torch.randn(5, 16, 64, device="cuda", generator=g).bfloat16()
    o_ref, lse_ref = mla_decode_reference(q, qr, store, bt, n_paged, 0.07)
    o, lse = launch(_wgmma_lowbit_kernel, q, qr, store, store.content, bt, n_paged, 0.07, 4, 4, 1)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    err = (o.float() - o_ref).norm(dim=-1) / o_ref.norm(dim=-1)
    assert float(err.max()) < 1e-2, float(err.max())  # bf16 output, fp16 operands
    assert torch.allclose(lse, lse_ref, atol=2e-3, rtol=1e-4)
