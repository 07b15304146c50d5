"""The window policy, and each of its consumers pinned to it: the cache's stores, the decode-cache simulation, the
engines' shadow windows. Elsewhere: the serving windows' decode against a float64 reference built from the
policy (tests/serving/test_windows.py), the prefill context's window marks (tests/serving/test_step_plans.py),
the kernels' shadow reads against that torch decode (tests/serving/test_shadow_kernels.py) and the kernels'
device split plan against the host plan, which pages the policy's range (tests/kernels/test_splits.py)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla import QuantizedLatentCache
from quantmla.formats import parse_scheme
from quantmla.formats.windows import SUB, WindowPolicy
from tiny_models import tiny_config

POLICIES = [WindowPolicy(4, 8), WindowPolicy(0, 5), WindowPolicy(3, 0), WindowPolicy(0, 0), WindowPolicy(4, 128)]


def _unquantised_set(policy: WindowPolicy, n: int) -> set[int]:
    """The definition, position by position: a sink, or one of the last ``recent``."""
    return {p for p in range(n) if p < policy.sink or p >= n - policy.recent}


def test_positions_short_and_long():
    policy = WindowPolicy(4, 8)
    pos, ok = policy.positions(torch.tensor([5, 12, 30]))
    assert pos[0, :5].tolist() == [0, 1, 2, 3, 4] and ok[0].tolist() == [True] * 5 + [False] * 7
    assert pos[1].tolist() == list(range(12)) and bool(ok[1].all())  # n = sink + recent: all in the window
    assert pos[2].tolist() == [0, 1, 2, 3, *range(22, 30)] and bool(ok[2].all())
    start, end = policy.paged_range(torch.tensor([5, 12, 30]))
    assert start.tolist() == [0, 0, 4] and end.tolist() == [0, 0, 22]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 9), st.integers(0, 20), st.lists(st.integers(0, 60), min_size=1, max_size=6))
def test_every_form_of_the_policy_agrees(sink, recent, lengths):
    """positions (torch and numpy), the paged range, the split, the elementwise rule and the decode mask all
    describe the same set of positions."""
    policy = WindowPolicy(sink, recent)
    lens_t, lens_n = torch.tensor(lengths), np.array(lengths)
    pos_t, ok_t = policy.positions(lens_t)
    pos_n, ok_n = policy.positions(lens_n)
    assert np.array_equal(pos_t.numpy(), pos_n) and np.array_equal(ok_t.numpy(), ok_n)
    start, end = policy.paged_range(lens_t)
    for i, n in enumerate(lengths):
        want = _unquantised_set(policy, n)
        assert set(pos_t[i][ok_t[i]].tolist()) == want
        assert len(want) == int(ok_t[i].sum())  # no position twice
        assert {p for p in range(n) if bool(policy.unquantised(p, n))} == want
        stored = set(range(int(start[i]), int(end[i])))
        assert stored == set(range(n)) - want  # the paged range is exactly the rest
        n_sink, n_mid, n_recent = policy.split(n)
        assert n_sink + n_mid + n_recent == n and n_mid == len(stored)
        assert want == set(range(n_sink)) | set(range(n - n_recent, n))
    s = max(lengths)
    mask = policy.decode_mask(s)
    for t in range(s):
        assert {j for j in range(t + 1) if bool(mask[t, j])} == _unquantised_set(policy, t + 1)


def test_prefill_reads_its_own_tokens_and_the_windows_of_its_end():
    policy = WindowPolicy(2, 3)
    got = [bool(policy.prefill_unquantised(p, 20, 4)) for p in range(20)]
    assert got == [p < 2 or p >= 16 for p in range(20)]  # new tokens 16..19 inside the recent window here
    got = [bool(policy.prefill_unquantised(p, 20, 9)) for p in range(20)]
    assert got == [p < 2 or p >= 11 for p in range(20)]  # the step's 9 tokens as computed, beyond the window


@pytest.mark.parametrize(("sink", "recent"), [(4, 128), (0, 16), (17, 0), (3, 5)])
def test_subpages_per_request_cover_any_alignment(sink, recent):
    """The sub-pages one request's window positions touch (position ``p`` lies in its request's sub-page
    ``p // SUB``: blocks are whole sub-pages), over every length: at most ``subpages_per_request``, and
    that many for some length."""
    policy = WindowPolicy(sink, recent)
    most = 0
    for n in range(1, 2 * (sink + recent) + 3 * SUB):
        pos, ok = policy.positions(torch.tensor([n]))
        most = max(most, len(set((pos[ok] // SUB).tolist())))
    assert most == policy.subpages_per_request


def test_bad_windows_name_the_value():
    with pytest.raises(ValueError, match="sink=-1 must be an integer >= 0"):
        WindowPolicy(-1, 4)
    with pytest.raises(ValueError, match="recent=2.5"):
        WindowPolicy(0, 2.5)


# -- the consumers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES[:4])
@pytest.mark.parametrize("chunks", [[70], [1] * 40, [9, 1, 1, 30, 1, 5]])
def test_the_cache_reads_what_the_policy_says(policy, chunks):
    """After every update, the cache's decode view holds the exact tokens where the policy reads them
    unquantised and the stored (quantised) ones elsewhere, whatever the update sizes."""
    cfg = tiny_config("deepseek_v3")
    total = sum(chunks)
    g = torch.Generator().manual_seed(0)
    c = torch.randn(1, 1, total, cfg.kv_lora_rank, generator=g)
    r = torch.randn(1, 1, total, cfg.qk_rope_head_dim, generator=g)
    cache = QuantizedLatentCache(cfg, scheme="c4r4", sink=policy.sink, recent=policy.recent, page_size=16)
    fmt = parse_scheme("c4r4")
    stored_c, stored_r = fmt.content.fake_quantize(c[0, 0]), fmt.rope.fake_quantize(r[0, 0])
    n = 0
    for k in chunks:
        cache.update(c[:, :, n : n + k], r[:, :, n : n + k], 0)
        n += k
        exact = policy.unquantised(torch.arange(n), n)[:, None]
        layer = cache.layers[0]
        assert torch.equal(layer.keys[0, 0], torch.where(exact, c[0, 0, :n], stored_c[:n]))
        assert torch.equal(layer.values[0, 0], torch.where(exact, r[0, 0, :n], stored_r[:n]))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_simulation_reads_what_the_policy_says(policy):
    from quantmla.measure.simulate import SimulatedDecodeCache

    sim = SimulatedDecodeCache(parse_scheme("c4r4"), sink=policy.sink, recent=policy.recent)
    assert torch.equal(sim.full_precision_mask(50, "cpu"), policy.decode_mask(50))


@pytest.mark.parametrize("policy", [p for p in POLICIES if p.enabled])
def test_the_shadow_window_reads_what_the_policy_says(policy):
    """The engines' decode window: the shadow rows of the policy's positions (tagged by position here), and
    the pages for the policy's paged range only."""
    from quantmla.serving.windows import ShadowRows, WindowPool

    bs, lens = 16, [3, policy.width, policy.width + 1, 75]
    blocks = -(-max(lens) // bs)
    table = torch.arange(len(lens) * blocks, dtype=torch.int32).view(len(lens), blocks)
    pool = WindowPool(policy, len(lens) * blocks * bs, len(lens), "cpu")
    shadow = ShadowRows(policy, len(lens), 2, torch.float64)
    lens_np = np.array(lens)
    pool.plan(table.numpy(), lens_np, lens_np, bs)  # a prefill of every token
    for i, n in enumerate(lens):  # tag each token: (request, position)
        pos = torch.arange(n)
        slots = table[i, pos // bs].long() * bs + pos % bs
        shadow.write(pool, slots, torch.full((n, 1), float(i), dtype=torch.float64), pos[:, None].double())
    win, win_len, start, end = shadow.window(pool, torch.zeros(1, bs, 1), table, torch.tensor(lens))
    want_start, want_end = policy.paged_range(torch.tensor(lens))
    assert start.tolist() == want_start.tolist() and end.tolist() == want_end.tolist()
    for i, n in enumerate(lens):
        rows = win[i, : int(win_len[i])]
        assert rows[:, 0].tolist() == [float(i)] * len(rows)  # every row its own request's
        assert sorted(int(p) for p in rows[:, 1]) == sorted(_unquantised_set(policy, n))
