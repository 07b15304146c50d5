import math

import torch

import quantmla
from quantmla.eval import PerplexityConfig, perplexity
from quantmla.models.loading import builtin_text


def _float64_kl(model, ids, scheme):
    from quantmla.eval.simulate import simulated_decode

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
