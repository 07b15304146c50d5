import math

import pytest
import torch

import quantmla
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.models.loading import builtin_text


def _float64_kl(model, ids, scheme):
    from quantmla.measure.simulate import simulated_decode

    with torch.no_grad():
        ref = torch.log_softmax(model(ids, use_cache=False).logits.double()[:, :-1], -1)
        with simulated_decode(model, scheme, sink=0, recent=0):
            out = torch.log_softmax(model(ids, use_cache=False).logits.double()[:, :-1], -1)
    return float((ref.exp() * (ref - out)).sum(-1).mean())


def test_kl_and_per_window_nll():
    model, tok = quantmla.load()
    text = builtin_text("test")
    cfg = dict(seq_len=64, num_seqs=3, batch_size=2, sink=0, recent=0, kl=True, per_window=True)
    bf16 = perplexity(model, tok, text, PerplexityConfig(scheme="bf16", **cfg), progress=False)
    assert bf16.kl == 0.0  # the bf16 "cache" of a float32 model through the same path: identical logits
    q = perplexity(model, tok, text, PerplexityConfig(scheme="c2r4", **cfg), progress=False)
    assert len(q.window_nll) == 3 and math.isclose(sum(q.window_nll) / q.tokens, q.nll, rel_tol=1e-6)  # float32 sums
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: 3 * 64]).view(3, 64)
    assert math.isclose(q.kl, _float64_kl(model, ids, "c2r4"), rel_tol=1e-3)
    assert q.kl > 1e-4 and q.ppl > bf16.ppl
    plain = perplexity(model, tok, text, PerplexityConfig(scheme="c2r4", seq_len=64, num_seqs=3, sink=0, recent=0))
    assert plain.kl is None and plain.window_nll is None and math.isclose(plain.nll, q.nll, rel_tol=1e-6)


def test_bytes_dtype_and_device_are_what_ran(monkeypatch):
    """Bytes/token from a real cache after the model's own prefill (no random tensors anywhere), in the
    model's dtype: a float64 model's unquantised windows take 8 bytes a value, a bfloat16 model's 2."""
    from quantmla import QuantizedLatentCache
    from quantmla.measure.tokens import token_windows
    from quantmla.models.compat import cache_kwargs

    def no_random(*args, **kwargs):
        raise AssertionError("perplexity() drew random tensors")

    text = builtin_text("test")
    for dtype, width in ((torch.float64, 8), (torch.bfloat16, 2)):
        model, tok = quantmla.load(dtype=dtype)
        cfg = PerplexityConfig(scheme="c2r4", seq_len=48, num_seqs=2, sink=2, recent=6)
        with monkeypatch.context() as mp:
            mp.setattr(torch, "randn", no_random)
            r = perplexity(model, tok, text, cfg, progress=False)
        assert (r.dtype, r.device, r.cache_backend) == (str(dtype).removeprefix("torch."), "cpu", "torch")
        assert r.unquantised_bytes_per_token == width * (256 + 64)
        cache = QuantizedLatentCache(model.config, scheme="c2r4", sink=2, recent=6)
        with torch.no_grad():
            model(token_windows(tok, text, 48, 1), use_cache=True, **cache_kwargs(cache))
        assert r.bytes_per_token == cache.nbytes() / (model.config.num_hidden_layers * 48)
        assert r.label == "c2r4"
        unq = perplexity(model, tok, text, PerplexityConfig(scheme="bf16", seq_len=48, num_seqs=1), progress=False)
        assert unq.label == ("bf16" if dtype == torch.bfloat16 else "unquantised (float64)")


def test_float64_nll_is_not_rounded_to_float32():
    """A float64 model's NLL equals the stock model's float64 loss to 1e-12 (casting the logits to float32
    first, as before, was off by ~5e-7)."""
    model, tok = quantmla.load(dtype=torch.float64)
    r = perplexity(model, tok, builtin_text("test"), PerplexityConfig(seq_len=64, num_seqs=1), progress=False)
    stock, _ = quantmla.load(dtype=torch.float64)  # transformers' own sdpa attention
    ids = torch.tensor(tok(builtin_text("test"), add_special_tokens=False)["input_ids"][:64]).view(1, 64)
    with torch.no_grad():  # not labels=ids: transformers' loss casts the logits to float32
        logits = stock(ids).logits
    assert logits.dtype == torch.float64
    ref = float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))
    assert math.isclose(r.nll, ref, rel_tol=1e-12)


def test_group_size_that_does_not_fit_fails_before_any_forward(monkeypatch):
    model, tok = quantmla.load()
    monkeypatch.setattr(model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("forward ran")))
    import pytest

    with pytest.raises(ValueError, match="group_size=48 does not divide the channel dimension 256"):
        perplexity(model, tok, builtin_text("test"), PerplexityConfig(scheme="c4r4", group_size=48), progress=False)


def test_spread_windows_are_evenly_spaced_over_the_text():
    from quantmla.measure.tokens import token_windows

    _, tok = quantmla.load()
    text = builtin_text("test")[:60_000]
    every = token_windows(tok, text, 64, None)
    spread = token_windows(tok, text, 64, 5, spread=True)
    n = every.shape[0]
    picks = [next(i for i in range(n) if torch.equal(every[i], w)) for w in spread]
    assert picks[0] == 0 and picks[-1] == n - 1 and len(picks) == 5
    gaps = [b - a for a, b in zip(picks, picks[1:], strict=False)]
    assert max(gaps) - min(gaps) <= 1
    assert token_windows(tok, text, 64, 10 * n, spread=True).shape[0] == n  # at most every window
    with pytest.raises(ValueError, match="give num_seqs"):
        PerplexityConfig(spread=True)


def test_bootstrap_intervals():
    from quantmla.eval.ppl import bootstrap_ppl, paired_bootstrap

    g = torch.Generator().manual_seed(3)
    nll = (torch.randn(40, generator=g) * 20 + 200).tolist()  # summed NLL of 40 windows of 64 tokens
    lo, hi = bootstrap_ppl(nll, 63)
    point = math.exp(sum(nll) / (40 * 63))
    assert lo < point < hi and (lo, hi) == bootstrap_ppl(nll, 63)
    assert paired_bootstrap(nll, nll, 63) == (0.0, 0.0)  # the same windows: no difference at all
    worse = [x + 6.3 + 0.5 * float(torch.randn(1, generator=g)) for x in nll]  # +0.1 nats a token
    lo, hi = paired_bootstrap(nll, worse, 63)
    assert 0.0 < lo < math.expm1(0.1) < hi  # paired: narrow around the shift, which unpaired spreads hide
