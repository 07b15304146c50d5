"""The Triton MLA decode kernels against torch references (CPU: Triton's interpreter, small shapes)."""

import math

import pytest
import torch

from decode_cases import SCHEMES, make_case
from quantmla.kernels import mla_decode_reference

triton = pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
from quantmla.kernels.decode import mla_decode  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def same_precision_reference(q, qr, store, bt, n_paged, scale, window, wl):
    """The computation in plain torch at the kernel's GPU precision (bf16 operands and probabilities,
    fp32 accumulation and output). Under the CPU interpreter the kernel computes in fp32, more exactly."""
    from quantmla.kernels.reference import gather_tokens

    B, H, DC = q.shape
    o = torch.zeros(B, H, DC)
    lse = torch.full((B, H), float("-inf"))
    for b in range(B):
        c, r = gather_tokens(store, bt, int(n_paged[b]), b)
        w = window[b, : int(wl[b])].float()
        c = torch.cat([c, w[:, :DC]]).bfloat16().float().cpu()
        r = torch.cat([r, w[:, DC:]]).bfloat16().float().cpu()
        if c.shape[0] == 0:
            continue
        s = (q[b].float().cpu() @ c.T + qr[b].float().cpu() @ r.T) * scale
        p = torch.softmax(s, -1)
        o[b] = p.bfloat16().float() @ c
        lse[b] = torch.logsumexp(s, -1)
    return o, lse


def check(o, lse, ref_o, ref_lse, same_prec):
    """abs, rel and cosine checks against the fp32 reference, each no worse than twice torch's own
    error at the kernel's precision (bf16 operands)."""
    same_prec, same_lse = same_prec
    o, lse, ref_o, ref_lse = o.float().cpu(), lse.cpu(), ref_o.cpu(), ref_lse.cpu()
    assert torch.isfinite(o).all() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        lse_err = (lse[fin] - ref_lse[fin]).abs().max()
        assert lse_err <= 2 * (same_lse[fin] - ref_lse[fin]).abs().max() + 1e-3, float(lse_err)
    err = (o - ref_o).norm() / ref_o.norm().clamp_min(1e-12)
    base = (same_prec - ref_o).norm() / ref_o.norm().clamp_min(1e-12)
    assert err <= 2 * base + 1e-3, (float(err), float(base))  # at most twice torch's own error
    assert (o - ref_o).abs().max() <= 2 * (same_prec - ref_o).abs().max() + 1e-3
    cos = torch.nn.functional.cosine_similarity(o.flatten(), ref_o.flatten(), dim=0)
    assert cos > 0.9999 or ref_o.norm() == 0


@pytest.mark.parametrize("bits", SCHEMES, ids=["bf16", "c4r4", "c2r4"])
@pytest.mark.parametrize(
    "lens,window_lens",
    [([1], [0]), ([5], [3]), ([131], [7]), ([217, 40], [0, 9]), ([1000], [12]), ([0, 0], [5, 2]), ([0, 33], [0, 4])],
)
def test_against_reference(bits, lens, window_lens):
    if sum(lens) + sum(window_lens) == 0:
        pytest.skip("nothing to attend")
    H, scale = 16, 0.15
    case = make_case(*bits, lens, window_lens, H)
    q, qr, store, bt, n_paged, window, wl = case
    o, lse = mla_decode(q, qr, store, bt, n_paged, scale, window, wl, num_splits=3, out_dtype=torch.float32)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, scale, window, wl)
    check(o, lse, ref_o, ref_lse, same_precision_reference(*case[:5], scale, window, wl))


@pytest.mark.parametrize("H", [1, 16, 20, 128])
@pytest.mark.parametrize("bits", SCHEMES, ids=["bf16", "c4r4", "c2r4"])
def test_head_counts_and_mixed_lengths(H, bits):
    lens, window_lens = [77, 3, 150], [5, 0, 11]
    case = make_case(*bits, lens, window_lens, H, seed=H)
    q, qr, store, bt, n_paged, window, wl = case
    o, lse = mla_decode(q, qr, store, bt, n_paged, 0.1, window, wl, out_dtype=torch.float32)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, 0.1, window, wl)
    check(o, lse, ref_o, ref_lse, same_precision_reference(*case[:5], 0.1, window, wl))


def test_deepseek_geometry_512():
    case = make_case(4, 4, [70, 20], [4, 6], 16, dc=512, page=64)
    q, qr, store, bt, n_paged, window, wl = case
    o, lse = mla_decode(q, qr, store, bt, n_paged, 0.07, window, wl, num_splits=2, out_dtype=torch.float32)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, 0.07, window, wl)
    check(o, lse, ref_o, ref_lse, same_precision_reference(*case[:5], 0.07, window, wl))


@pytest.mark.parametrize("bits", SCHEMES, ids=["bf16", "c4r4", "c2r4"])
@pytest.mark.parametrize("boost", [0.8, 4.0])
def test_late_score_spikes(bits, boost):
    """A late token whose score jumps above the running maximum (by a factor below 2^8 and far above
    it: the fp16 probabilities overflow unless the accumulators are rescaled), for one head of each
    sequence."""
    from quantmla.kernels.reference import gather_tokens

    H, scale, lens, spikes = 16, 0.1, [300, 200], ((0, 250), (1, 130))
    case = make_case(*bits, lens, [0, 0], H, seed=3)
    q, qr, store, bt, n_paged, _, _ = case
    for b, t in spikes:  # token t of sequence b points along head b's query
        idx = torch.tensor([t], device=q.device)
        c = (q[b, b].float() * boost)[None]
        store.write(bt[b, idx // 16].long(), idx % 16, c, torch.zeros(1, 64, device=q.device))
    for b, t in spikes:
        c, r = gather_tokens(store, bt, lens[b], b)
        sc = (c.float().cpu() @ q[b, b].float().cpu() + r.float().cpu() @ qr[b, b].float().cpu()) * scale
        jump = float(sc[t] - sc[:t].max()) / math.log(2)
        assert (jump > 8) if boost > 1 else (0 < jump < 8), jump
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, scale)
    empty = torch.zeros(2, 1, q.shape[-1] + 64, dtype=torch.bfloat16, device=q.device)
    zero = torch.zeros(2, dtype=torch.int32, device=q.device)
    o, lse = mla_decode(q, qr, store, bt, n_paged, scale, num_splits=2, out_dtype=torch.float32)
    check(o, lse, ref_o, ref_lse, same_precision_reference(q, qr, store, bt, n_paged, scale, empty, zero))


def test_no_window_and_split_counts_agree():
    q, qr, store, bt, n_paged, _, _ = make_case(2, 4, [300, 64], [0, 0], 16)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, 0.1)
    empty = torch.zeros(2, 1, q.shape[-1] + 64, dtype=torch.bfloat16, device=q.device)
    zero = torch.zeros(2, dtype=torch.int32, device=q.device)
    same = same_precision_reference(q, qr, store, bt, n_paged, 0.1, empty, zero)
    for splits in (1, 2, 7, 19):  # 19 > the combine chunk of 8
        o, lse = mla_decode(q, qr, store, bt, n_paged, 0.1, num_splits=splits, out_dtype=torch.float32)
        check(o, lse, ref_o, ref_lse, same)


@pytest.mark.parametrize("block_d", [32, 64, 128])
def test_combine_against_float64(block_d, monkeypatch):
    """The log-sum-exp merge of split partials, for several channel blocks per program: empty splits
    (LSE -inf; the kernels write no output there, so whatever it holds, NaN here, is never read), a row
    with no split at all, and LSEs far apart."""
    import quantmla.kernels.decode as dec

    monkeypatch.setattr(dec, "COMBINE_BLOCK_D", block_d)
    g = torch.Generator().manual_seed(3)
    B, S, H, DC = 3, 11, 5, 128
    op = torch.randn(B, S, H, DC, generator=g)
    lp = torch.randn(B, S, H, generator=g) * 30
    lp[0, 3:7] = float("-inf")
    op[0, 3:7] = float("nan")
    lp[1, :, 2] = float("-inf")  # (b=1, h=2): nothing to attend
    op[1, :, 2] = float("nan")
    o, lse = dec.combine_splits(op.to(DEV), lp.to(DEV), torch.float32)
    w = torch.softmax(lp.double(), dim=1).nan_to_num(0.0)
    ref = (w[..., None] * op.double().nan_to_num(0.0)).sum(1)
    ref[1, 2] = 0.0
    ref_lse = torch.logsumexp(lp.double(), dim=1)
    torch.testing.assert_close(o.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [8, 32, 128])
@pytest.mark.parametrize("wins", [0, 1, 3])
def test_combine_reads_only_the_used_splits(wins, chunk, monkeypatch):
    """With per-sequence counts of splits that have tokens (a CUDA graph's grid holds more), the merge reads
    splits ``[0, used[b])`` and the last ``wins`` slots (the windows'); the slots between hold finite partials
    here that would change the result if they were read. Steps of 8, 32 and 128 splits (the last two more than
    the grid's 21; 128 on four warps)."""
    import quantmla.kernels.decode as dec

    monkeypatch.setattr(dec, "COMBINE_CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    B, S, H, DC = 4, 21, 3, 64
    op = torch.randn(B, S, H, DC, generator=g)
    lp = torch.randn(B, S, H, generator=g) * 3
    used = torch.tensor([0, 1, 9, 20 - wins], dtype=torch.int32)
    keep = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        keep[b, : int(used[b])] = True
        keep[b, S - wins :] = wins > 0
    lk = lp.double().masked_fill(~keep[..., None], float("-inf"))
    w = torch.softmax(lk, dim=1).nan_to_num(0.0)
    ref = (w[..., None] * op.double()).sum(1)
    ref_lse = torch.logsumexp(lk, dim=1)
    o, lse = dec.combine_splits(op.to(DEV), lp.to(DEV), torch.float32, used=used.to(DEV), window_slots=wins)
    torch.testing.assert_close(o.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)
    if not wins:
        assert torch.isinf(lse[0]).all() and (o[0] == 0).all()  # no split: nothing attended
    with pytest.raises(ValueError, match="window_slots=22"):
        dec.combine_splits(op.to(DEV), lp.to(DEV), torch.float32, used=used.to(DEV), window_slots=22)


@pytest.mark.parametrize("bits", SCHEMES, ids=["bf16", "c4r4", "c2r4"])
def test_queries_read_in_place_with_their_strides(bits):
    """vLLM hands the decode a transposed product ``[B, H, d_c]`` (heads outermost in memory) and a split
    of ``[B, H, d_c + d_r]``: the kernels read them with their strides and give the contiguous queries'
    result, windows included."""
    q, qr, store, bt, n_paged, window, wl = make_case(*bits, [300, 77, 0], [5, 0, 3], 16, page=16, seed=4)
    B, H, DC = q.shape
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # strides (DC, B * DC, 1)
    joint = torch.cat([q, qr], dim=-1)
    q_s, qr_s = joint.split([DC, 64], dim=-1)  # strides (H * (DC + 64), DC + 64, 1)
    assert not q_t.is_contiguous() and not qr_s.is_contiguous()
    want = mla_decode(q, qr, store, bt, n_paged, 0.1, window, wl, out_dtype=torch.float32)
    for qa, qb in ((q_t, qr_s), (q_s, qr_s)):
        got = mla_decode(qa, qb, store, bt, n_paged, 0.1, window, wl, out_dtype=torch.float32)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_launcher_rejects_bad_inputs():
    q, qr, store, bt, n_paged, window, wl = make_case(4, 4, [10], [2], 4)
    with pytest.raises(ValueError, match="bfloat16"):
        mla_decode(q.float(), qr, store, bt, n_paged, 0.1)
    with pytest.raises(ValueError, match="do not match the store"):
        mla_decode(q[..., :64], qr, store, bt, n_paged, 0.1)
    with pytest.raises(ValueError, match="together"):
        mla_decode(q, qr, store, bt, n_paged, 0.1, window=window)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, qr, store, bt.long(), n_paged, 0.1)
    with pytest.raises(ValueError, match="maxnreg=300"):
        mla_decode(q, qr, store, bt, n_paged, 0.1, maxnreg=300)
    with pytest.raises(ValueError, match="partial_dtype=torch.int32"):
        mla_decode(q, qr, store, bt, n_paged, 0.1, partial_dtype=torch.int32)


@pytest.mark.parametrize("bits", SCHEMES[1:], ids=["c4r4", "c2r4"])
def test_half_partials(bits):
    """Split partials stored in float16 (quantised stores): within the reference's bounds, and within one
    rounding of fp16 (relative to the output's scale) of the float32 partials' result; 7 splits and a window,
    so the combine merges several rounded partials. A BF16 store keeps float32 partials."""
    partial = torch.float16
    case = make_case(*bits, [300, 77], [5, 3], 16, seed=6)
    q, qr, store, bt, n_paged, window, wl = case
    kw = dict(num_splits=7, out_dtype=torch.float32)
    o32, lse32 = mla_decode(q, qr, store, bt, n_paged, 0.1, window, wl, **kw)
    o, lse = mla_decode(q, qr, store, bt, n_paged, 0.1, window, wl, partial_dtype=partial, **kw)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, 0.1, window, wl)
    check(o, lse, ref_o, ref_lse, same_precision_reference(*case[:5], 0.1, window, wl))
    torch.testing.assert_close(lse, lse32)  # the log-sum-exps stay float32
    eps = torch.finfo(partial).eps
    assert 0 < (o - o32).abs().max() <= eps * o32.abs().max()
    bf16 = make_case(16, 16, [30], [2], 4)
    with pytest.raises(ValueError, match="quantised store"):
        mla_decode(*bf16[:5], 0.1, partial_dtype=partial)


def test_left_padding_masks():
    case = make_case(4, 4, [130, 70], [6, 6], 16, dc=512, page=64, seed=3)
    q, qr, store, bt, n_paged, window, wl = case
    ps = torch.tensor([0, 9], dtype=torch.int32, device=q.device)
    ws = torch.tensor([4, 2], dtype=torch.int32, device=q.device)
    kw = dict(paged_start=ps, window_skip=ws)
    o, lse = mla_decode(q, qr, store, bt, n_paged, 0.07, window, wl, out_dtype=torch.float32, **kw)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, 0.07, window, wl, **kw)
    full_o, _ = mla_decode_reference(q, qr, store, bt, n_paged, 0.07, window, wl)
    assert (ref_o - full_o).abs().max() > 1e-3  # the masks matter
    assert (o.cpu() - ref_o.cpu()).abs().max() < 2e-2 * ref_o.abs().max()
    assert (lse.cpu() - ref_lse.cpu()).abs().max() < 2e-2 * ref_lse.abs().max()


@pytest.mark.parametrize("bits", SCHEMES, ids=["bf16", "c4r4", "c2r4"])
def test_planned_splits_pad_and_mixed_lengths(bits):
    """The default launch (splits planned on the device): a batch padded with empty sequences gives its
    real rows' output, and mixed lengths agree with the reference."""
    lens = [700, 0, 1500, 33, 0, 0]
    q, qr, store, bt, n_paged, window, wl = make_case(*bits, lens, [0] * len(lens), 16, page=16)
    ref_o, ref_lse = mla_decode_reference(q, qr, store, bt, n_paged, 0.1)
    same = same_precision_reference(q, qr, store, bt, n_paged, 0.1, window[:, :0], torch.zeros_like(wl))
    o, lse = mla_decode(q, qr, store, bt, n_paged, 0.1, out_dtype=torch.float32)
    check(o, lse, ref_o, ref_lse, same)
    keep = [0, 2, 3]
    o2, lse2 = mla_decode(q[keep], qr[keep], store, bt[keep], n_paged[keep], 0.1, out_dtype=torch.float32)
    torch.testing.assert_close(o2, o[keep], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse2, lse[keep], rtol=1e-4, atol=1e-4)
