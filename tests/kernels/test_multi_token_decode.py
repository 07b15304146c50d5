"""Several query tokens a sequence (a speculative-decoding step): each token attends causally to its own prefix,
against a float64 reference and against the one-token kernel run at each token's length (CPU: Triton's
interpreter)."""

import pytest
import torch

from quantmla.kernels import mla_decode_reference

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
from decode_cases import SCHEMES, float64_decode, make_case  # noqa: E402

ON_GPU = torch.cuda.is_available()
from quantmla.kernels.decode import mla_decode  # noqa: E402


def queries(B, S, H, dc, seed):
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(B, S, H, dc, generator=g).bfloat16().to(dev)
    qr = torch.randn(B, S, H, 64, generator=g).bfloat16().to(dev)
    return q, qr


@pytest.mark.parametrize("bits", SCHEMES, ids=["bf16", "c4r4", "c2r4"])
@pytest.mark.parametrize("S", [2, 4])
def test_causal_query_tokens_against_float64(bits, S):
    """Lengths 5, 131, 217, 1000 (several pages and splits; the last tile of a token's prefix ends inside a
    page), one of exactly ``S`` tokens and a padded (empty) sequence: each token's output and log-sum-exp as the
    float64 reference of its own prefix, and different from attending to the whole sequence."""
    lens = [5, 131, 217, 1000, S, 0]
    H, scale = 16, 0.15
    _, _, store, bt, n, _, _ = make_case(*bits, lens, [0] * len(lens), H, seed=S)
    q, qr = queries(len(lens), S, H, store.layout.kv_lora_rank, seed=S)
    o, lse = mla_decode(q, qr, store, bt, n, scale, num_splits=3, out_dtype=torch.float32)
    assert o.shape == (len(lens), S, H, 128) and lse.shape == (len(lens), S, H)
    want_o, want_lse = float64_decode(q, qr, store, bt, n, scale)
    # the interpreter computes in fp32 (the low-bit kernel's queries in fp16); the GPU in bf16 / fp16
    tol = (2e-2 if bits == (16, 16) else 5e-3) if ON_GPU else (1e-4 if bits == (16, 16) else 2e-3)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)  # the empty sequence: -inf, nothing attended
    torch.testing.assert_close(lse.cpu().double()[fin], want_lse[fin], atol=tol * 10, rtol=0)
    torch.testing.assert_close(o.cpu().double()[fin], want_o[fin], atol=tol * 4, rtol=0)
    err = (o.cpu().double()[:3, 0] - want_o[:3, 0]).abs().max()
    whole, _ = mla_decode_reference(q[:, 0], qr[:, 0], store, bt, n, scale)  # token 0 over the whole sequence
    assert (whole[:3].cpu().double() - want_o[:3, 0]).abs().max() > 10 * err  # causality is visible


@pytest.mark.parametrize("bits", SCHEMES[1:], ids=["c4r4", "c2r4"])
def test_each_token_as_its_own_decode(bits):
    """Each of 3 query tokens gives what the one-token kernel gives at its own length (the same arithmetic up to
    the split plan), and the 4-D reference agrees; 128 heads: two query rows a head group apart."""
    lens = [300, 77]
    H, S = 128, 3
    _, _, store, bt, n, _, _ = make_case(*bits, lens, [0, 0], H, seed=5)
    q, qr = queries(len(lens), S, H, store.layout.kv_lora_rank, seed=5)
    o, lse = mla_decode(q, qr, store, bt, n, 0.1, num_splits=2, out_dtype=torch.float32)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n, 0.1)
    tol = 3e-3 if ON_GPU else 1e-5  # the same arithmetic up to where the splits' pages begin (fp16 on the GPU)
    for t in range(S):
        one, one_lse = mla_decode(q[:, t], qr[:, t], store, bt, n - (S - 1 - t), 0.1, num_splits=2,
                                  out_dtype=torch.float32)  # fmt: skip
        torch.testing.assert_close(o[:, t], one, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, t], one_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(o.cpu(), ref_o.cpu(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=2e-2, rtol=2e-2)


def test_query_tokens_read_with_their_strides():
    """vLLM's queries ``[B * S, H, d]`` as a transposed product (heads outermost) and a split of the joint
    query, viewed ``[B, S, H, d]``: the same result as contiguous queries."""
    lens, S, H = [200, 40], 2, 16
    _, _, store, bt, n, _, _ = make_case(4, 4, lens, [0, 0], H, seed=7)
    q, qr = queries(len(lens), S, H, 128, seed=7)
    want = mla_decode(q, qr, store, bt, n, 0.1, out_dtype=torch.float32)
    flat = q.flatten(0, 1)  # [B * S, H, d]
    q_t = flat.transpose(0, 1).contiguous().transpose(0, 1).unflatten(0, (len(lens), S))
    q_s, qr_s = torch.cat([q, qr], -1).split([128, 64], -1)
    assert not q_t.is_contiguous() and not q_s.is_contiguous()
    for qa, qb in ((q_t, qr_s), (q_s, qr_s)):
        got = mla_decode(qa, qb, store, bt, n, 0.1, out_dtype=torch.float32)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_query_tokens_refuse_a_window_buffer():
    q3, qr3, store, bt, n, window, wl = make_case(4, 4, [10], [2], 4)
    q, qr = q3[:, None].expand(-1, 2, -1, -1), qr3[:, None].expand(-1, 2, -1, -1)
    with pytest.raises(ValueError, match="shadows"):
        mla_decode(q, qr, store, bt, n, 0.1, window, wl)
    with pytest.raises(ValueError, match=r"\[B, S, H, d\]"):
        mla_decode(q, qr3, store, bt, n, 0.1)
    with pytest.raises(ValueError, match="num_warps=16"):
        mla_decode(q3, qr3, store, bt, n, 0.1, num_warps=16)
