"""The Triton kernels' side of the windows: the fused write fills the shadow rows as the torch write does,
and the decode kernel reading the window rows in place equals the torch path and a float64 reference of
the policy (CPU: Triton's interpreter)."""

import pytest
import torch

from decode_cases import shadow_engine
from quantmla.formats.records import RecordLayout
from quantmla.formats.windows import SUB, WindowPolicy
from quantmla.kernels.decode import ShadowWindow, mla_decode
from quantmla.kernels.layout import PagedLatentStore
from quantmla.serving.paged_decode import paged_decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DC, DR, BS, H = 128, 64, 32, 16
LENS = (150, 40, 7)


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4"])
def test_the_fused_write_fills_the_shadow_rows_as_the_torch_write(scheme):
    _, _, pool, shadow, ref, _, _ = shadow_engine(scheme, WindowPolicy(4, 48))
    used = pool.map[pool.map >= 0].long()
    rows = (used[:, None] * SUB + torch.arange(SUB, device=DEV)).flatten()
    assert rows.numel() > 0 and torch.equal(shadow.rows[rows], ref.rows[rows])


@pytest.mark.parametrize("wsplits", [1, 2, 4])
@pytest.mark.parametrize(("scheme", "sink", "recent"), [("c2r4", 4, 48), ("c4r4", 0, 33)])
def test_decode_reads_the_window_rows_in_place(scheme, sink, recent, wsplits):
    """Over one window program a (sequence, head group) and over several, each a run of the window's tiles
    (52 rows in 16-row tiles: one program of 4 tiles, 2 of 2, 4 of 1; 33 rows: 3 tiles, one or two a
    program)."""
    cfg = WindowPolicy(sink, recent)
    lay, pages, pool, shadow, _, table, tokens = shadow_engine(scheme, cfg)
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(len(LENS), H, DC + DR, generator=g) / 4).bfloat16().to(DEV)
    seq = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    store = PagedLatentStore.from_pages(pages, lay)
    got, _ = mla_decode(q[..., :DC].contiguous(), q[..., DC:].contiguous(), store, table, seq, 0.1,
                        shadow=ShadowWindow(shadow.rows, pool.map, sink, recent), window_splits=wsplits)  # fmt: skip
    win, win_len, start, n_paged = shadow.window(pool, pages, table, seq)
    torch_path = paged_decode(q[..., :DC], q[..., DC:], pages, lay, table, n_paged, 0.1, window=win,
                              window_len=win_len, paged_start=start)  # fmt: skip
    for b, n in enumerate(LENS):  # float64: the window tokens as computed, the others as stored
        x = tokens[b].double()
        sc, sr = lay.unpack(lay.pack(x[:, :DC].float(), x[:, DC:].float()))
        j = torch.arange(n, device=DEV)
        keep = ((j < sink) | (j >= n - recent))[:, None]
        kv = torch.where(keep, x, torch.cat([sc, sr], -1).double())
        s = (q[b].double() @ kv.T) * 0.1
        want = torch.softmax(s, -1) @ kv[:, :DC]
        torch.testing.assert_close(torch_path[b].double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[b].double(), want, atol=2e-2, rtol=2e-2)
        if n > sink + recent:  # the check can tell the windows from the stored tokens
            allq = torch.softmax((q[b].double() @ torch.cat([sc, sr], -1).double().T) * 0.1, -1) @ sc.double()
            assert (allq - want).abs().max() > 3 * (got[b].double() - want).abs().max()
    assert pool.misses == 0


def policy_reference(lay, tokens, q, n, sink, recent, scale):
    """float64 decode of one query over the first ``n`` tokens under the window policy of length ``n``: the sinks
    and the last ``recent`` as computed, the others as stored."""
    x = tokens[:n].double()
    sc, sr = lay.unpack(lay.pack(x[:, :DC].float(), x[:, DC:].float()))
    j = torch.arange(n, device=DEV)
    keep = ((j < sink) | (j >= n - recent))[:, None]
    kv = torch.where(keep, x, torch.cat([sc, sr], -1).double())
    return torch.softmax((q.double() @ kv.T) * scale, -1) @ kv[:, :DC]


@pytest.mark.parametrize(
    ("scheme", "sink", "recent", "S"), [("c4r4", 4, 48, 3), ("c2r4", 0, 33, 4), ("c4r4", 4, 48, 2)]
)
def test_query_tokens_read_their_own_windows(scheme, sink, recent, S):
    """A step of ``S`` tokens a request (speculative decoding): query token ``t`` reads the exact policy of its own
    length ``n - S + 1 + t`` (its own last ``recent`` tokens unquantised, up to ``S - 1`` positions before the
    step's window), in one launch; lengths 150 (pages and windows), 40 (all window for some tokens) and 7."""
    cfg = WindowPolicy(sink, recent)
    lay, pages, pool, shadow, _, table, tokens = shadow_engine(scheme, cfg, last=S)
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(len(LENS), S, H, DC + DR, generator=g) / 4).bfloat16().to(DEV)
    seq = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    store = PagedLatentStore.from_pages(pages, lay)
    got, _ = mla_decode(q[..., :DC], q[..., DC:], store, table, seq, 0.1, num_splits=2,
                        shadow=ShadowWindow(shadow.rows, pool.map, sink, recent))  # fmt: skip
    assert got.shape == (len(LENS), S, H, DC)
    told = False
    for b, n in enumerate(LENS):
        for t in range(S):
            m = n - (S - 1 - t)
            want = policy_reference(lay, tokens[b], q[b, t], m, sink, recent, 0.1)
            torch.testing.assert_close(got[b, t].double(), want, atol=2e-2, rtol=2e-2)
            if m > sink + recent and t < S - 1:  # the step's shared window would quantise other tokens
                shared = policy_reference(lay, tokens[b], q[b, t], m, sink, recent + S - 1 - t, 0.1)
                told |= bool((shared - want).abs().max() > 3 * (got[b, t].double() - want).abs().max())
    assert told and pool.misses == 0


def test_shadow_windows_exclude_an_explicit_window():
    rows = torch.zeros(17, DC + DR, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int32"):
        ShadowWindow(rows, torch.zeros(4, dtype=torch.int64), 4, 8)
    with pytest.raises(ValueError, match="bfloat16"):
        ShadowWindow(rows.float(), torch.zeros(4, dtype=torch.int32), 4, 8)


def test_shadow_windows_need_a_quantised_store():
    lay = RecordLayout("bf16", DC, DR, 64)
    pages = torch.zeros(4, BS, lay.record_bytes, dtype=torch.uint8, device=DEV)
    q = torch.zeros(1, H, DC + DR, dtype=torch.bfloat16, device=DEV)
    shadow = ShadowWindow(torch.zeros(17, DC + DR, dtype=torch.bfloat16, device=DEV),
                          torch.full((8,), -1, dtype=torch.int32, device=DEV), 4, 8)  # fmt: skip
    table = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="BF16 store"):
        mla_decode(q[..., :DC].contiguous(), q[..., DC:].contiguous(), PagedLatentStore.from_pages(pages, lay), table,
                   torch.tensor([5], dtype=torch.int32, device=DEV), 0.1, shadow=shadow)  # fmt: skip
