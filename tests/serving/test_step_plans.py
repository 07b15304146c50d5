"""The step's plans: the prefill context's slots and window marks against a loop over vLLM's chunked-context
layout, made once a step and told apart by chunk."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import quantmla.serving.vllm.step_plans as sp
from quantmla.formats.windows import WindowPolicy
from quantmla.serving.vllm.short_extends import decode_tokens
from quantmla.serving.vllm.step_plans import ContextChunk, StepPlans, context_slots

BS = 4


def _chunked_context(lens, starts, seed=0):
    """vLLM's arguments for one chunk: each request ``r`` reads ``lens[r]`` context tokens from position
    ``starts[r]``; a block table of distinct random pages."""
    g = torch.Generator().manual_seed(seed)
    pages = max((s + n + BS - 1) // BS for s, n in zip(starts, lens, strict=True)) + 1
    table = torch.randperm(len(lens) * pages, generator=g).reshape(len(lens), pages).int()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    to_seq = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
    return table, cu, to_seq, torch.tensor(starts, dtype=torch.int32)


def _loop_reference(table, lens, starts, window, ends):
    slots, wanted = [], []
    for r, (n, s) in enumerate(zip(lens, starts, strict=True)):
        for p in range(s, s + n):
            slots.append(int(table[r, p // BS]) * BS + p % BS)
            wanted.append(bool(window.unquantised(p, ends[r])))
    return slots, wanted


@pytest.mark.parametrize("window", [WindowPolicy(4, 8), WindowPolicy(0, 3), WindowPolicy(2, 0)])
def test_context_slots_follow_vllms_chunk_layout(window):
    lens, starts, ends = [5, 1, 13, 7], [0, 9, 6, 2], [30, 12, 40, 9]
    table, cu, to_seq, st = _chunked_context(lens, starts)
    plan = context_slots(ContextChunk(table, cu, to_seq, sum(lens), BS, st, window, torch.tensor(ends)))
    want_slots, want_marks = _loop_reference(table, lens, starts, window, ends)
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == want_slots
    assert plan.wanted.tolist() == want_marks
    bare = context_slots(ContextChunk(table, cu, to_seq, sum(lens), BS, st))  # no windows: slots alone
    assert bare.wanted is None and bare.slots.tolist() == want_slots


def test_context_slots_without_starts_read_from_position_zero():
    lens = [3, 6]
    table, cu, to_seq, _ = _chunked_context(lens, [0, 0], seed=1)
    assert context_slots(ContextChunk(table, cu, to_seq, 9, BS)).slots.tolist() == _loop_reference(
        table, lens, [0, 0], WindowPolicy(0, 0), [9, 9])[0]  # fmt: skip


def test_vllm_033_runs_of_requests_read_their_own_window_ends():
    """vLLM 0.33 gathers each context chunk for a run of prefill requests: the block table sliced to the run,
    ``token_to_seq`` and ``starts`` local to it. Each run's marks equal the loop over its requests at their own
    ends; the ends of the whole step indexed by local request numbers (the bug this guards) mark other tokens."""
    window = WindowPolicy(2, 3)
    lens, starts, ends = [5, 3, 6, 4], [0, 4, 1, 0], [8, 12, 9, 30]
    table, *_ = _chunked_context(lens, starts, seed=2)
    all_ends = torch.tensor(ends)
    chunks = []
    for run in (slice(0, 2), slice(2, 4)):  # vLLM 0.33's ContextChunk, two runs of two requests
        _, cu, to_seq, st = _chunked_context(lens[run], starts[run])
        chunks.append(SimpleNamespace(request_slice=run, cu_seq_lens=cu, token_to_seq=to_seq, starts=st))
    runs = sp.context_runs(SimpleNamespace(chunked_context=SimpleNamespace(chunks=chunks)))
    assert list(runs.values()) == [slice(0, 2), slice(2, 4)]
    for c in chunks:
        r, n = c.request_slice, sum(lens[c.request_slice])
        ends_run = sp.run_ends(all_ends, runs, c.cu_seq_lens)
        plan = context_slots(ContextChunk(table[r], c.cu_seq_lens, c.token_to_seq, n, BS, c.starts, window, ends_run))
        want_slots, want_marks = _loop_reference(table[r], lens[r], starts[r], window, ends[r])
        assert plan.slots.tolist() == want_slots and plan.wanted.tolist() == want_marks
        if r.start:  # the step's ends by local index: the first run's ends, other marks
            stale = context_slots(ContextChunk(table[r], c.cu_seq_lens, c.token_to_seq, n, BS, c.starts, window,
                                               all_ends))  # fmt: skip
            assert stale.wanted.tolist() != want_marks
    # vLLM 0.26: no runs (every chunk spans all prefills), the ends as given
    old_chunk = SimpleNamespace(cu_seq_lens=chunks[1].cu_seq_lens)  # 0.26's chunks have no request_slice
    assert sp.context_runs(SimpleNamespace(chunked_context=SimpleNamespace(chunks=[old_chunk]))) == {}
    assert sp.run_ends(all_ends, {}, chunks[1].cu_seq_lens) is all_ends
    assert sp.context_runs(SimpleNamespace(chunked_context=None)) == {}


def test_window_and_ends_come_together():
    table, cu, to_seq, st = _chunked_context([2], [0])
    with pytest.raises(ValueError, match="window and ends"):
        ContextChunk(table, cu, to_seq, 2, BS, st, window=WindowPolicy(4, 8))


def test_a_step_plans_each_chunk_once_and_tells_chunks_apart(monkeypatch):
    made = []
    real = sp.context_slots
    monkeypatch.setattr(sp, "context_slots", lambda c: made.append(c) or real(c))
    # two chunks of one step as vLLM lays them out: rows of 2-D tensors, the same token count
    lens_a, lens_b, starts_b = [3, 5], [6, 2], [3, 5]
    table, cu_a, seq_a, _ = _chunked_context(lens_a, [0, 0], seed=2)
    _, cu_b, seq_b, st_b = _chunked_context(lens_b, starts_b, seed=2)
    cu, to_seq = torch.stack([cu_a, cu_b]), torch.stack([seq_a, seq_b])
    starts = torch.stack([torch.zeros(2, dtype=torch.int32), st_b])
    ends = torch.tensor([20, 20])
    plans = StepPlans()
    # each layer builds its own ContextChunk from the same tensors (views made anew, as vLLM's [i] does)
    window = WindowPolicy(1, 2)
    chunk = [lambda i=i: ContextChunk(table, cu[i], to_seq[i], 8, BS, starts[i], window, ends) for i in (0, 1)]
    first = [plans.context(c()) for c in chunk]
    again = [plans.context(c()) for c in chunk]  # layers 2..
    assert len(made) == 2 and all(a is b for a, b in zip(first, again, strict=True))
    for plan, lens, st in zip(first, (lens_a, lens_b), ([0, 0], starts_b), strict=True):
        assert plan.slots.tolist() == _loop_reference(table, lens, st, WindowPolicy(1, 2), [20, 20])[0]
    assert StepPlans().context(chunk[0]()) is not first[0]  # next step


def test_a_step_maps_its_decode_rows_once():
    rows = decode_tokens(np.array([0, 1, 4, 6]), 3)
    table = torch.arange(9, dtype=torch.int32).reshape(3, 3)
    lens = torch.tensor([10, 50, 7], dtype=torch.int32)
    plans = StepPlans()
    t, n = plans.decode_rows(rows, table, lens)
    want_t, want_n = rows.rows(table, lens)
    assert torch.equal(t, want_t) and torch.equal(n, want_n)
    assert plans.decode_rows(rows, table, lens)[0] is t
    other = torch.tensor([11, 51, 8], dtype=torch.int32)  # other lengths: another plan
    assert plans.decode_rows(rows, table, other)[1].tolist() == rows.rows(table, other)[1].tolist()
