"""transformers' assisted decoding (a draft model, prompt lookup) with ``QuantizedLatentCache`` as the cache: it
verifies drafted tokens in one multi-token step and ``crop``s the rejected ones."""

import pytest
import torch

from cache_reads import assert_same_reads
from quantmla import QuantizedLatentCache, enable_latent_attention
from quantmla.cache.latent_cache import QuantizedLatentLayer
from quantmla.models.compat import cache_kwargs
from tiny_models import tiny_model

NEW = 24


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 10), generator=g)
    return torch.cat([ids, ids, ids[:, :6]], 1)  # repeats, so prompt lookup drafts tokens


def _generate(model, ids, scheme, sink, recent, **kw):
    cache = QuantizedLatentCache(model.config, scheme=scheme, sink=sink, recent=recent, page_size=16)
    out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **cache_kwargs(cache), **kw)
    return out, cache


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize(
    "scheme,sink,recent",
    [("bf16", 2, 5), ("c4r4", 4, 128)],  # where a multi-token step reads what token-by-token decode reads
)
def test_assisted_decoding_matches_greedy(family, scheme, sink, recent, prompt):
    model = enable_latent_attention(tiny_model(family))
    greedy, _ = _generate(model, prompt, scheme, sink, recent)
    lookup, _ = _generate(model, prompt, scheme, sink, recent, prompt_lookup_num_tokens=4)
    assistant = enable_latent_attention(tiny_model(family, seed=1))
    drafted, _ = _generate(model, prompt, scheme, sink, recent, assistant_model=assistant)
    assert torch.equal(lookup, greedy)
    assert torch.equal(drafted, greedy)


class _Replay:
    """Records every update of a cache and, at each crop, checks the cache against a fresh one that gets the
    same updates less the removed tokens (what a cache that never saw them holds)."""

    def __init__(self, cache: QuantizedLatentCache, config, monkeypatch) -> None:
        self.cache, self.config, self.calls, self.crops, self.restored = cache, config, [], 0, 0
        update, crop = cache.update, cache.crop

        def logged_update(key, value, layer_idx, *args, **kwargs):
            self.calls.append((layer_idx, key.detach().clone(), value.detach().clone()))
            return update(key, value, layer_idx, *args, **kwargs)

        def checked_crop(tokens_to_remove):
            n2 = cache.get_seq_length() + tokens_to_remove
            self.restored += sum(
                max(0, hi - lo) for lyr in cache.layers for lo, hi in [lyr.restore_span(n2)] if lyr.is_initialized
            )
            crop(tokens_to_remove)
            self.crops += tokens_to_remove < 0
            self._drop(-tokens_to_remove)
            self._check()

        monkeypatch.setattr(cache, "update", logged_update)
        monkeypatch.setattr(cache, "crop", checked_crop)

    def _drop(self, k: int) -> None:
        for layer in range(len(self.cache.layers)):
            left = k
            for i in range(len(self.calls) - 1, -1, -1):
                idx, key, value = self.calls[i]
                if idx != layer or left == 0:
                    continue
                cut = min(left, key.shape[2])
                self.calls[i] = (idx, key[:, :, : key.shape[2] - cut], value[:, :, : value.shape[2] - cut])
                left -= cut
        self.calls = [c for c in self.calls if c[1].shape[2]]

    def _check(self) -> None:
        cfg = self.cache.cache_config
        fresh = QuantizedLatentCache(self.config, scheme=cfg.scheme.name, sink=cfg.sink, recent=cfg.recent,
                                     page_size=cfg.page_size)  # fmt: skip
        for idx, key, value in self.calls:
            fresh.update(key, value, idx)
        assert_same_reads(self.cache, fresh)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_every_crop_in_assisted_decoding_is_exact(family, prompt, monkeypatch):
    """Small windows, so drafted tokens push earlier ones into the quantised middle and rejected drafts bring
    them back: after every crop the cache equals one fed the kept tokens only."""
    model = enable_latent_attention(tiny_model(family))
    cache = QuantizedLatentCache(model.config, scheme="c4r4", sink=2, recent=3, page_size=16)
    replay = _Replay(cache, model.config, monkeypatch)
    assistant = enable_latent_attention(tiny_model(family, seed=1))
    model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, assistant_model=assistant,
                   **cache_kwargs(cache))  # fmt: skip
    assert replay.crops > 0 and replay.restored > 0  # rejected drafts, and evictions undone


def test_without_the_restore_a_crop_is_not_exact(prompt, monkeypatch):
    monkeypatch.setattr(QuantizedLatentLayer, "restore_span", lambda self, n2: (0, 0))
    with pytest.raises(AssertionError):
        test_every_crop_in_assisted_decoding_is_exact("deepseek_v3", prompt, monkeypatch)


@pytest.mark.parametrize(
    "scheme,sink,recent,warned", [("c4r4", 2, 3, True), ("c4r4", 4, 128, False), ("bf16", 2, 3, False)]
)
def test_a_verify_step_past_the_windows_is_announced(scheme, sink, recent, warned, prompt, caplog):
    """A verify step reads with the prefill policy; where that differs from token-by-token decode (a quantised
    scheme, a request longer than the windows) the cache says so once, never silently."""
    model = enable_latent_attention(tiny_model("deepseek_v3"))
    with caplog.at_level("WARNING", logger="quantmla.cache.latent_cache"):
        _generate(model, prompt, scheme, sink, recent, prompt_lookup_num_tokens=4)
    notes = [r for r in caplog.records if "assisted decoding's verify" in r.getMessage()]
    assert len(notes) == int(warned)
