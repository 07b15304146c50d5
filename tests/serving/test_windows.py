"""The sink and recent windows in paged pages: the shadow pool against the exact policy (no vLLM needed)."""

import numpy as np
import pytest
import torch

from quantmla.formats.records import RecordLayout
from quantmla.formats.windows import SUB, WindowPolicy
from quantmla.serving.paged_decode import paged_decode
from quantmla.serving.windows import ShadowRows, WindowPool

DC, DR, H = 64, 32, 4


class Engine:
    """A paged engine in miniature: requests get blocks from a shuffled free list, write their tokens
    each step (records and shadows) and decode through the windows."""

    def __init__(self, cfg, block_size=32, num_blocks=48, max_reqs=3, scheme="c4r4", seed=0, extra=0):
        self.cfg, self.bs = cfg, block_size
        self.layout = RecordLayout(scheme, DC, DR, 32)
        self.pages = torch.zeros(num_blocks, block_size, self.layout.record_bytes, dtype=torch.uint8)
        self.pool = WindowPool(cfg, num_blocks * block_size, max_reqs, "cpu", extra=extra)
        self.shadow = ShadowRows(cfg, max_reqs, DC + DR, torch.float32, extra=extra)
        self.pool.register(0, lambda rows, slots: self.shadow.repair(self.read, rows, slots))
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, torch.Tensor] = {}  # every token as computed, per request

    def step(self, grow: dict[int, int], short: bool = False):
        """Requests ``rid`` add ``grow[rid]`` tokens this step (a new ``rid``: its prefill). ``short``: their
        tokens attend one by one as decode tokens (the pool's extended windows); returns which got them."""
        for rid, k in grow.items():
            have = self.tokens.get(rid, torch.empty(0, DC + DR))
            new = torch.randn(k, DC + DR, generator=self.gen)
            self.tokens[rid] = torch.cat([have, new])
            while len(self.tables.setdefault(rid, [])) * self.bs < len(self.tokens[rid]):
                self.tables[rid].append(int(self.free.pop()))
        rids = list(grow)
        table, seq = self.table(rids)
        q = np.array(list(grow.values()))
        granted = self.pool.plan(table.numpy(), seq.numpy(), q, self.bs, short=np.full(q.size, short))
        for rid, k in grow.items():
            n = len(self.tokens[rid])
            pos = torch.arange(n - k, n)
            slots = torch.tensor(self.tables[rid])[pos // self.bs] * self.bs + pos % self.bs
            c, r = self.tokens[rid][-k:].split([DC, DR], dim=-1)
            self.layout.write_pages(self.pages, slots, c, r)
            self.shadow.write(self.pool, slots, c, r)
        return granted

    def finish(self, rid: int) -> None:
        self.free.extend(self.tables.pop(rid))
        self.tokens.pop(rid)

    def table(self, rids):
        width = max(len(self.tables[r]) for r in rids)
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in rids], dtype=torch.int32)
        return table, torch.tensor([len(self.tokens[r]) for r in rids])

    def read(self, slots):
        c, r = self.layout.unpack(self.layout.read_slots(self.pages, slots))
        return torch.cat([c, r], dim=-1)

    def decode(self, rids, q_nope, q_pe, lengths=None):
        """Decode rows of requests ``rids`` (repeats allowed), each of its full length or of ``lengths``."""
        table, seq = self.table(rids)
        seq = seq if lengths is None else torch.tensor(lengths)
        win, win_len, start, n_paged = self.shadow.window(self.pool, self.pages, table, seq)
        return paged_decode(q_nope, q_pe, self.pages, self.layout, table, n_paged, 0.1, window=win,
                            window_len=win_len, paged_start=start)  # fmt: skip

    def reference(self, rid, q_nope, q_pe, as_stored=(), length=None):
        """float64 attention of one query over the policy's view of request ``rid`` (its first ``length``
        tokens; positions ``as_stored`` read as stored even in the window)."""
        x = self.tokens[rid][:length]
        n = len(x)
        c, r = x.split([DC, DR], dim=-1)
        sc, sr = self.layout.unpack(self.layout.pack(c, r))
        stored = torch.cat([sc, sr], dim=-1)
        keep = self.cfg.unquantised(torch.arange(n), n)  # the window policy
        keep[list(as_stored)] = False
        kv = torch.where(keep[:, None], x, stored).double()
        s = (q_nope.double() @ kv[:, :DC].T + q_pe.double() @ kv[:, DC:].T) * 0.1
        return torch.softmax(s, -1) @ kv[:, :DC]


@pytest.mark.parametrize(("sink", "recent", "bs"), [(4, 24, 32), (4, 40, 16), (0, 16, 64), (3, 0, 32)])
def test_decode_through_the_shadows_is_the_exact_policy(sink, recent, bs):
    eng = Engine(WindowPolicy(sink, recent), block_size=bs, num_blocks=64, max_reqs=4)
    eng.step({0: 5, 1: 70, 2: 33})  # prefills: shorter and longer than the windows
    for t in range(40):
        grow = {0: 1, 1: 1, 2: 1} if t != 20 else {0: 1, 1: 1, 2: 1, 3: 50}  # a prefill joins mid-way
        eng.step(grow)
        rids = list(grow)
        q_nope, q_pe = torch.randn(len(rids), H, DC), torch.randn(len(rids), H, DR)
        got = eng.decode(rids, q_nope, q_pe)
        for i, rid in enumerate(rids):
            want = eng.reference(rid, q_nope[i], q_pe[i])
            torch.testing.assert_close(got[i].double(), want, atol=2e-5, rtol=2e-5)
    assert eng.pool.misses == 0


def test_the_reference_tells_the_windows_apart():
    """The check above fails if the windows were read as stored (so it can catch a broken plan)."""
    eng = Engine(WindowPolicy(4, 24))
    eng.step({0: 60})
    q_nope, q_pe = torch.randn(1, H, DC), torch.randn(1, H, DR)
    eng.shadow.rows.zero_()  # the window rows lost
    got = eng.decode([0], q_nope, q_pe)[0].double()
    assert (got - eng.reference(0, q_nope[0], q_pe[0])).abs().max() > 1e-3


def test_finished_requests_give_their_shadows_to_new_ones():
    eng = Engine(WindowPolicy(4, 24), max_reqs=2, num_blocks=96)
    for wave in range(6):  # 12 requests through a pool sized for 2 at once
        a, b = 2 * wave, 2 * wave + 1
        eng.step({a: 40, b: 9})
        for _ in range(10):
            eng.step({a: 1, b: 1})
        q_nope, q_pe = torch.randn(2, H, DC), torch.randn(2, H, DR)
        got = eng.decode([a, b], q_nope, q_pe)
        for i, rid in enumerate((a, b)):
            torch.testing.assert_close(got[i].double(), eng.reference(rid, q_nope[i], q_pe[i]), atol=2e-5, rtol=2e-5)
        eng.finish(a)
        eng.finish(b)
    assert eng.pool.misses == 0


def test_a_pool_too_small_for_the_step_is_an_error():
    eng = Engine(WindowPolicy(4, 24), max_reqs=1)
    with pytest.raises(RuntimeError, match="more requests at once than it was sized for"):
        eng.step({0: 40, 1: 40})


def test_an_evicted_shadow_is_repaired_from_its_record_and_counted():
    eng = Engine(WindowPolicy(0, SUB), block_size=16, max_reqs=1, num_blocks=32)
    eng.step({0: SUB + 2})  # request 0: its window [2, SUB + 2) needs 2 sub-pages, all the pool has
    eng.step({1: SUB + 2})  # request 1 takes both while 0 waits
    assert eng.pool.misses == 0
    # back in the batch: its sub-pages get shadows again, taken from request 1; the rows request 1 wrote there
    # must not pass for request 0's: its SUB - 1 older window tokens are repaired from their records, its new
    # one is the shadow's own
    eng.step({0: 1})
    assert eng.pool.misses == SUB - 1
    q_nope, q_pe = torch.randn(1, H, DC), torch.randn(1, H, DR)
    got = eng.decode([0], q_nope, q_pe)[0].double()
    want = eng.reference(0, q_nope[0], q_pe[0], as_stored=range(3, SUB + 2))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _assert_rows_match_the_policy(eng, rids, lens, as_stored=()):
    """Decode rows ``rids`` of lengths ``lens`` through the pages and shadows equal the float64 reference of
    the policy (positions ``as_stored`` read as stored)."""
    q_nope, q_pe = torch.randn(len(rids), H, DC), torch.randn(len(rids), H, DR)
    got = eng.decode(rids, q_nope, q_pe, lens)
    for i, (rid, n) in enumerate(zip(rids, lens, strict=True)):
        want = eng.reference(rid, q_nope[i], q_pe[i], as_stored=as_stored, length=n)
        torch.testing.assert_close(got[i].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("sink", "recent", "bs"), [(4, 24, 32), (4, 40, 16), (0, 16, 64), (3, 0, 32)])
def test_short_extends_attend_token_by_token_through_the_windows(sink, recent, bs):
    # a chunked prompt's last tokens as decode rows: row j of q reads the exact policy for its own length,
    # so its window reaches up to q - 1 positions before the step's (the last step's window)
    eng = Engine(WindowPolicy(sink, recent), block_size=bs, num_blocks=64, max_reqs=4)
    eng.step({0: 90, 1: 3})
    for grow in ({0: 7, 1: 1}, {0: 1, 1: 12}, {0: 3, 1: 5}):
        assert eng.step(grow, short=True).all()
        rids = [rid for rid, k in grow.items() for _ in range(k)]
        lens = [len(eng.tokens[rid]) - k + 1 + j for rid, k in grow.items() for j in range(k)]
        _assert_rows_match_the_policy(eng, rids, lens)
    assert eng.pool.misses == 0


def test_a_short_extend_keeps_its_earlier_window_when_the_pool_is_full():
    # request 0's last-step window is the oldest in a full pool: the step's own new sub-pages would evict its
    # rows that the extend's first tokens read, unless the plan keeps them
    eng = Engine(WindowPolicy(4, 24), max_reqs=2, num_blocks=64)
    eng.step({0: 60})
    eng.step({1: 30})
    eng.step({1: 1})
    eng.step({1: 4})  # request 1 takes the last free sub-page
    assert eng.step({0: 6}, short=True).all()
    _assert_rows_match_the_policy(eng, [0] * 6, list(range(61, 67)))
    assert eng.pool.misses == 0


def test_a_short_extends_lost_earlier_window_is_repaired_from_its_records_and_counted():
    eng = Engine(WindowPolicy(4, 24), max_reqs=2, num_blocks=64)
    eng.step({0: 60})
    eng.step({1: 30})
    eng.step({1: 1})
    eng.step({1: 8})  # two new sub-pages for request 1, one free: request 0's oldest goes (positions 36-39)
    assert eng.step({0: 6}, short=True).all()
    assert eng.pool.misses == 3  # positions 37-39, in the windows of its first three tokens only
    _assert_rows_match_the_policy(eng, [0] * 6, list(range(61, 67)), as_stored=range(37, 40))


def test_short_extends_the_pool_cannot_hold_attend_as_prefills():
    eng = Engine(WindowPolicy(4, 24), max_reqs=2, num_blocks=64)
    eng.step({0: 80, 1: 80})  # two requests: every shadow the pool has is theirs
    granted = eng.step({0: 9, 1: 1}, short=True)
    assert granted.tolist() == [False, True]  # no shadow to spare for request 0's earlier windows
    assert eng.pool.misses == 0


@pytest.mark.parametrize(("sink", "recent", "k"), [(4, 24, 3), (4, 25, 2), (0, 16, 7)])
def test_a_pool_sized_for_drafts_grants_every_speculative_step(sink, recent, k):
    """With ``extra=k`` (speculative decoding's drafts) a full pool (every request running, all at long lengths)
    grants every step of ``k + 1`` tokens a request as decode tokens, each token at its own length's exact
    policy; sized without them, the same steps would not all be granted."""
    cfg = WindowPolicy(sink, recent)
    for extra in (k, 0):
        eng = Engine(cfg, block_size=16, num_blocks=96, max_reqs=3, extra=extra)
        eng.step({0: 70, 1: 45, 2: 101})
        ok = [bool(eng.step({0: k + 1, 1: k + 1, 2: k + 1}, short=True).all()) for _ in range(4)]
        if extra:
            assert all(ok) and eng.pool.misses == 0
            lens = [len(eng.tokens[r]) - k + j for r in range(3) for j in range(k + 1)]
            _assert_rows_match_the_policy(eng, [r for r in range(3) for _ in range(k + 1)], lens)
        else:
            assert not all(ok)
    assert cfg.subpages(k) > cfg.subpages_per_request and cfg.shadow_rows(3, k) == cfg.subpages(k) * 3 * SUB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream-sync check needs CUDA (sync debug mode)")
def test_planning_on_cuda_never_waits_for_the_stream():
    """vLLM prepares a step while the GPU runs the one before (asynchronous scheduling): the plan's map
    updates and repairs must not synchronise the stream. PyTorch's sync debug mode raises on any
    synchronising call (a blocking copy from pageable memory among them); the map ends as a CPU pool's fed
    the same steps."""
    cfg = WindowPolicy(0, SUB)
    pools = [WindowPool(cfg, 32 * 16, 1, dev) for dev in ("cpu", "cuda")]
    repaired = []
    pools[1].register(0, lambda rows, slots: repaired.append(rows.numel()))
    t0, t1 = np.arange(0, 4)[None, :], np.arange(4, 8)[None, :]
    one = np.ones(1, dtype=np.int64)
    steps = [(t0, [SUB + 2], [SUB + 2]), (t1, [SUB + 2], [SUB + 2]), (t0, [SUB + 3], one)]  # 0, 1, 0 again
    steps += [(t0, [SUB + 3 + k], one) for k in range(1, 9)]  # request 0 decodes across sub-pages
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for table, lens, q in steps:
            for pool in pools:
                pool.plan(table, np.array(lens), np.asarray(q), 16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert repaired and pools[1].misses == pools[0].misses > 0  # request 0's rows were repaired on its return
    assert torch.equal(pools[1].map.cpu(), pools[0].map)
