"""``crop``: removing the last tokens leaves the cache exactly as a cache that never saw them (what attention
reads, bit for bit, and the bytes it holds), within what past recording kept; beyond that it refuses."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_reads import assert_same_reads
from quantmla import QuantizedLatentCache
from quantmla.cache.latent_cache import QuantizedLatentLayer
from quantmla.cache.paged_store import PagedPathStore
from tiny_models import tiny_config

CFG = tiny_config("deepseek_v3")  # latent 128, RoPE 64, 2 layers
DC, DR = 128, 64
#: a per-token scheme, the unquantised one, FP8, and one whose RoPE key is quantised per channel in pages of 4
SCHEMES = ("c4r4", "bf16", "fp8", "c4r4p4")


def _cache(scheme: str, sink: int, recent: int) -> QuantizedLatentCache:
    return QuantizedLatentCache(CFG, scheme=scheme, sink=sink, recent=recent, page_size=16)


def _tokens(n: int, batch: int = 2):
    return torch.randn(batch, 1, n, DC, dtype=torch.bfloat16), torch.randn(batch, 1, n, DR, dtype=torch.bfloat16)


def _feed(cache, c, r, start, stop, step):
    for t in range(start, stop, step):
        e = min(stop, t + step)
        for layer in range(len(cache.layers)):
            cache.update(c[:, :, t:e], r[:, :, t:e], layer)


def _assert_same(a: QuantizedLatentCache, b: QuantizedLatentCache) -> None:
    assert_same_reads(a, b)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.nbytes() == lb.nbytes()


def _crop_vs_never_seen(scheme, sink, recent, prefix, drafted, removed, step=1, seed=0):
    torch.manual_seed(seed)
    c, r = _tokens(prefix + drafted)
    cropped, never = _cache(scheme, sink, recent), _cache(scheme, sink, recent)
    _feed(cropped, c, r, 0, prefix, prefix)  # a prefill
    cropped.activate_past_recording()
    _feed(cropped, c, r, prefix, prefix + drafted, step)
    cropped.crop(-removed)
    _feed(never, c, r, 0, prefix, prefix)
    _feed(never, c, r, prefix, prefix + drafted - removed, step)
    _assert_same(cropped, never)
    return cropped, never, (c, r)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("sink,recent", [(4, 16), (0, 0), (2, 3), (0, 5)])
@pytest.mark.parametrize("prefix", [1, 3, 19, 20, 21, 22, 33])
def test_crop_equals_a_cache_that_never_saw_the_tokens(scheme, sink, recent, prefix):
    for drafted in (1, 4, 7):
        for removed in range(drafted + 1):
            _crop_vs_never_seen(scheme, sink, recent, prefix, drafted, removed)


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(SCHEMES),
    sink=st.integers(0, 5),
    recent=st.integers(0, 9),
    prefix=st.integers(1, 40),
    drafted=st.integers(1, 12),
    data=st.data(),
)
def test_crop_property(scheme, sink, recent, prefix, drafted, data):
    removed = data.draw(st.integers(0, drafted))
    step = data.draw(st.integers(1, drafted))  # a verify step appends several tokens at once
    cropped, never, (c, r) = _crop_vs_never_seen(scheme, sink, recent, prefix, drafted, removed, step)
    # and both go on identically (the recording span restarted: a second round crops exactly too)
    cropped.activate_past_recording()
    nxt_c, nxt_r = _tokens(3)
    for cache in (cropped, never):
        _feed(cache, nxt_c, nxt_r, 0, 3, 1)
    cropped.crop(-2)
    never2 = _cache(scheme, sink, recent)
    n = never.get_seq_length() - 2
    _feed(never2, c, r, 0, prefix, prefix)
    _feed(never2, c, r, prefix, n - 1, step)
    _feed(never2, nxt_c, nxt_r, 0, 1, 1)
    _assert_same(cropped, never2)


def test_crop_restores_evicted_tokens_unquantised(monkeypatch):
    """The restore matters: without it the tokens pushed out of the recent window stay quantised."""
    _crop_vs_never_seen("c4r4", 0, 4, 10, 5, 3)
    monkeypatch.setattr(QuantizedLatentLayer, "restore_span", lambda self, n2: (0, 0))
    with pytest.raises(AssertionError):
        _crop_vs_never_seen("c4r4", 0, 4, 10, 5, 3)


def test_crop_puts_a_paged_store_page_back_unquantised(monkeypatch):
    _crop_vs_never_seen("c4r4p4", 0, 0, 10, 5, 4)
    monkeypatch.setattr(PagedPathStore, "set_recording", lambda self, on: setattr(self, "retained", None))
    with pytest.raises(RuntimeError, match="page of 4 quantised per channel before past recording"):
        _crop_vs_never_seen("c4r4p4", 0, 0, 10, 5, 4)


def test_crop_beyond_the_recording_is_refused_and_changes_nothing():
    c, r = _tokens(30)
    cache = _cache("c4r4", 2, 4)
    _feed(cache, c, r, 0, 20, 1)  # not recording: tokens left the window quantised
    before = [x.clone() for x in cache.layers[0]._view(torch.float32)]
    with pytest.raises(RuntimeError, match=r"cannot crop cache layer 0 from 20 to 19 tokens.*activate_past_rec"):
        cache.crop(-1)
    assert cache.get_seq_length() == 20
    assert all(torch.equal(x, y) for x, y in zip(before, cache.layers[0]._view(torch.float32), strict=True))
    cache.activate_past_recording()
    _feed(cache, c, r, 20, 23, 1)
    with pytest.raises(RuntimeError, match="from 23 to 19 tokens"):  # 4 > the 3 appended since
        cache.crop(-4)
    cache.crop(-3)  # within the recording
    assert cache.get_seq_length() == 20
    _feed(cache, c, r, 20, 22, 1)
    cache.crop(0)  # every crop starts a new span
    _feed(cache, c, r, 22, 23, 1)
    with pytest.raises(RuntimeError, match="before the last crop"):
        cache.crop(-2)


def test_crop_within_the_windows_needs_no_recording():
    c, r = _tokens(10)
    cache, never = _cache("c4r4", 4, 128), _cache("c4r4", 4, 128)
    _feed(cache, c, r, 0, 10, 1)
    cache.crop(-6)
    _feed(never, c, r, 0, 4, 1)
    _assert_same(cache, never)


@pytest.mark.parametrize("bad", [2, 1.5, True])
def test_crop_argument_is_a_negative_count(bad):
    cache = _cache("c4r4", 4, 16)
    with pytest.raises(ValueError, match=rf"crop\(tokens_to_remove={bad!r}\): pass how many tokens to remove"):
        cache.crop(bad)
    _feed(cache, *_tokens(3), 0, 3, 3)
    with pytest.raises(ValueError, match="holds 3 tokens"):
        cache.crop(-4)


def test_cache_is_croppable_and_recording_survives_the_first_update():
    cache = _cache("c4r4", 0, 2)
    assert cache.is_croppable
    cache.activate_past_recording()  # before any update (transformers' assisted decoding may do this)
    assert all(cache.is_recording_past(i) for i in range(len(cache.layers)))
    c, r = _tokens(6)
    _feed(cache, c, r, 0, 6, 1)
    cache.crop(-3)
    never = _cache("c4r4", 0, 2)
    _feed(never, c, r, 0, 3, 1)
    _assert_same(cache, never)


def test_reorder_after_recording_keeps_the_recorded_rows():
    c, r = _tokens(20, batch=3)
    cache = _cache("c4r4", 1, 3)
    _feed(cache, c, r, 0, 10, 10)
    cache.activate_past_recording()
    _feed(cache, c, r, 10, 16, 1)
    cache.reorder_cache(torch.tensor([2, 0]))
    cache.crop(-4)
    never = _cache("c4r4", 1, 3)
    _feed(never, c[[2, 0]], r[[2, 0]], 0, 10, 10)
    _feed(never, c[[2, 0]], r[[2, 0]], 10, 12, 1)
    _assert_same(cache, never)


@pytest.mark.parametrize("scheme", ["c4r4", "bf16"])
def test_crop_of_the_kernel_layout_layer(scheme):
    """The triton backend's layer keeps the middle in kernel pages: a crop hands pages back to the pool."""
    pytest.importorskip("triton", reason="triton is an optional dependency")

    def cache():
        c = QuantizedLatentCache(CFG, scheme=scheme, sink=2, recent=3, page_size=16, backend="triton")
        c.declare_latent_reader()
        return c

    for prefix, drafted, removed in ((10, 9, 7), (14, 4, 4), (30, 6, 3), (16, 1, 1)):
        c, r = _tokens(prefix + drafted)
        cropped, never = cache(), cache()
        _feed(cropped, c, r, 0, prefix, prefix)
        cropped.activate_past_recording()
        _feed(cropped, c, r, prefix, prefix + drafted, 1)
        cropped.crop(-removed)
        _feed(never, c, r, 0, prefix, prefix)
        _feed(never, c, r, prefix, prefix + drafted - removed, 1)
        assert cropped.backends_used() == ["triton", "triton"]
        _assert_same(cropped, never)
        _feed(cropped, c, r, 0, 5, 1)  # and the pages handed back are reused alike
        _feed(never, c, r, 0, 5, 1)
        _assert_same(cropped, never)
