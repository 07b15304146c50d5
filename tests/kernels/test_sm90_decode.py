"""The sm_90a decode kernel (quantmla.kernels.hopper) against float64 and against the Triton kernel: lengths 1, 5,
131, 217, 1000 and an empty sequence, NaN-poisoned unused pages, a permuted block table, page sizes 16-128,
64 and 128 heads, several query tokens, left padding, shadow windows in the same softmax, a CUDA graph. GPU
only (an sm_90 device and nvcc); which calls it serves and refuses is checked on the CPU too."""

import pytest
import torch

from decode_cases import float64_decode, make_case, shadow_engine
from quantmla.formats.windows import WindowPolicy
from quantmla.kernels import PagedLatentStore, PagedLayout
from quantmla.kernels.hopper import query_reason, unsupported

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
from quantmla.kernels.decode import ShadowWindow, mla_decode  # noqa: E402
from quantmla.kernels.hopper import missing  # noqa: E402

REASON = missing() if torch.cuda.is_available() else "no CUDA device"
sm90 = pytest.mark.skipif(REASON is not None, reason=f"the sm_90a kernel needs {REASON}")
LENS = [1, 5, 131, 217, 1000, 0]
BITS = [(4, 4), (2, 4)]


def check(o, lse, want_o, want_lse, tol=5e-3):
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    torch.testing.assert_close(lse.cpu().double()[fin], want_lse[fin], atol=tol * 10, rtol=0)
    torch.testing.assert_close(o.cpu().double()[fin], want_o[fin], atol=tol * 4, rtol=0)


def queries(B, S, H, seed, dc=512):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, dc, generator=g).bfloat16().cuda()
    qr = torch.randn(B, S, H, 64, generator=g).bfloat16().cuda()
    return q, qr


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("bits", BITS, ids=["c4r4", "c2r4"])
@pytest.mark.parametrize(("H", "page", "splits"), [(128, 64, None), (64, 16, 3), (64, 128, None), (128, 32, 7)])
def test_sm90_against_float64_and_triton(bits, H, page, splits):
    _, _, store, bt, n, _, _ = make_case(*bits, LENS, [0] * len(LENS), 1, dc=512, page=page, seed=H + page)
    q, qr = queries(len(LENS), 1, H, seed=page)
    kw = dict(num_splits=splits, out_dtype=torch.float32)
    o, lse = mla_decode(q, qr, store, bt, n, 0.1, kernel="sm90", **kw)
    assert mla_decode.last_backend == "sm90"
    check(o, lse, *float64_decode(q, qr, store, bt, n, 0.1))
    t_o, t_lse = mla_decode(q, qr, store, bt, n, 0.1, kernel="triton", **kw)
    torch.testing.assert_close(o, t_o, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse, t_lse, atol=3e-3, rtol=3e-3)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("bits", BITS, ids=["c4r4", "c2r4"])
@pytest.mark.parametrize(("S", "H"), [(2, 32), (4, 16), (4, 128)])
def test_sm90_query_tokens_are_causal(bits, S, H):
    _, _, store, bt, n, _, _ = make_case(*bits, [5, 131, 217, 1000, S, 0], [0] * 6, 1, dc=512, page=64, seed=S)
    q, qr = queries(6, S, H, seed=S)
    o, lse = mla_decode(q, qr, store, bt, n, 0.1, out_dtype=torch.float32, kernel="sm90")
    check(o, lse, *float64_decode(q, qr, store, bt, n, 0.1))


@sm90
@pytest.mark.gpu
def test_sm90_left_padding_and_half_partials():
    _, _, store, bt, n, _, _ = make_case(4, 4, LENS, [0] * len(LENS), 1, dc=512, page=64, seed=3)
    q, qr = queries(len(LENS), 1, 64, seed=3)
    start = torch.tensor([0, 2, 70, 0, 999, 0], dtype=torch.int32, device="cuda")
    o, lse = mla_decode(q, qr, store, bt, n, 0.1, paged_start=start, out_dtype=torch.float32, kernel="sm90",
                        partial_dtype=torch.float16)  # fmt: skip
    check(o, lse, *float64_decode(q, qr, store, bt, n, 0.1, start=start))


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize(("scheme", "sink", "recent", "S"), [("c4r4", 4, 48, 1), ("c2r4", 0, 33, 3)])
def test_sm90_with_shadow_windows_equals_triton(scheme, sink, recent, S):
    lay, pages, pool, shadow, _, table, _ = shadow_engine(scheme, WindowPolicy(sink, recent), last=S, dc=512)
    q, qr = queries(3, S, 64, seed=5)
    seq = torch.tensor((150, 40, 7), dtype=torch.int32, device="cuda")
    store = PagedLatentStore.from_pages(pages, lay)
    sw = ShadowWindow(shadow.rows, pool.map, sink, recent)
    got = mla_decode(q, qr, store, table, seq, 0.1, shadow=sw, kernel="sm90", out_dtype=torch.float32)
    want = mla_decode(q, qr, store, table, seq, 0.1, shadow=sw, kernel="triton", out_dtype=torch.float32)
    torch.testing.assert_close(got[0], want[0], atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got[1], want[1], atol=3e-3, rtol=3e-3)


@sm90
@pytest.mark.gpu
def test_sm90_replays_in_a_cuda_graph():
    _, _, store, bt, n, _, _ = make_case(4, 4, [300, 77, 1000], [0] * 3, 1, dc=512, page=64, seed=4)
    q, qr = queries(3, 1, 128, seed=4)
    eager = mla_decode(q, qr, store, bt, n, 0.1)
    assert mla_decode.last_backend == "sm90"  # the default at >= 64 query rows on sm_90
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mla_decode(q, qr, store, bt, n, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_decode(q, qr, store, bt, n, 0.1, min_batch=2)
    g.replay()
    torch.testing.assert_close(out[0], eager[0], atol=0, rtol=0)
    n.copy_(torch.tensor([77, 5, 0], dtype=torch.int32))  # new lengths, same graph
    g.replay()
    want = mla_decode(q, qr, store, bt, n, 0.1, kernel="triton")
    torch.testing.assert_close(out[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)


def test_which_calls_the_sm90_kernel_serves():
    """Refusals name the reason (CPU: the layout and shape checks, before any machine check)."""
    cpu = torch.device("cpu")
    assert "BF16" in unsupported(PagedLayout(16, 16), 128, cpu)
    assert "512 + 64" in unsupported(PagedLayout(4, 4, kv_lora_rank=256), 128, cpu)
    assert "16 query rows" in unsupported(PagedLayout(4, 4), 16, cpu)
    assert unsupported(PagedLayout(4, 4, page_size=16), 64, cpu) == "a cpu tensor"
    gpu = torch.device("cuda")
    other = torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0)
    want = "the kernel is built for sm_90" if other else None
    got = unsupported(PagedLayout(2, 4, page_size=128), 128, gpu, check_machine=False)
    assert got == want or (want is not None and want in got)


def test_mla_decode_refuses_sm90_where_it_cannot_serve():
    q, qr, store, bt, n, _, _ = make_case(16, 16, [5], [0], 16, dc=128, page=16)
    with pytest.raises(ValueError, match="kernel='sm90' cannot serve this call: .*BF16"):
        mla_decode(q, qr, store, bt, n, 0.1, kernel="sm90")
    with pytest.raises(ValueError, match="kernel='fast'; valid: auto, sm90, triton"):
        mla_decode(q, qr, store, bt, n, 0.1, kernel="fast")


def test_queries_the_sm90_kernel_reads_in_place():
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    assert query_reason(q[..., :512], q[..., 512:]) is None  # one [c | k^R] query tensor, sliced
    assert "q_lat rows not 16-byte" in query_reason(q[..., 1:513], q[..., 512:])
    assert "q_pe rows not 4-byte" in query_reason(q[..., :512], q[..., 511:575])
    wide = torch.zeros(2, 1, 16, 1024, dtype=torch.bfloat16)
    assert "contiguous channels" in query_reason(wide[..., ::2], q[..., 512:])
