"""QuantizedLatentCache's triton backend: decode through the fused kernel gives the torch path's tokens.

On CPU the kernel runs in Triton's interpreter (slow, so short generations); on a GPU for real.
"""

import pytest
import torch

import quantmla
from quantmla.models.compat import cache_kwargs
from quantmla.models.loading import builtin_text

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_and_batch():
    m, tok = quantmla.load(dtype=torch.bfloat16, device=DEV)
    quantmla.enable_latent_attention(m)
    ids = tok(builtin_text("test")[:3000], return_tensors="pt").input_ids[:, :150]
    padded = torch.cat([torch.full((1, 20), tok.pad_token_id), ids[:, :130]], 1)  # left padding
    batch = torch.cat([ids, padded]).to(DEV)
    mask = torch.ones_like(batch)
    mask[1, :20] = 0
    return m, tok, batch, mask


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4", "bf16"])
def test_greedy_tokens_match_torch_path(model_and_batch, scheme):
    m, tok, batch, mask = model_and_batch
    kw = dict(input_ids=batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    ref_cache = quantmla.QuantizedLatentCache(m.config, scheme=scheme, recent=16, backend="torch")
    ref = m.generate(**kw, **cache_kwargs(ref_cache))
    cache = quantmla.QuantizedLatentCache(m.config, scheme=scheme, recent=16, backend="triton")
    out = m.generate(**kw, **cache_kwargs(cache))
    assert set(cache.backends_used()) == {"triton"} and set(ref_cache.backends_used()) == {"torch"}
    assert torch.equal(out, ref)
    if scheme != "bf16":  # quantised tokens really went through pages, and bytes are counted from them
        layer = cache.layers[0]
        assert layer.n_mid == batch.shape[1] + 6 - 1 - 4 - 16 and layer.sink_c.length == 4
        assert cache.nbytes() < ref_cache.nbytes() * 1.01


def test_backend_errors():
    cfg = quantmla.load()[0].config
    with pytest.raises(ValueError, match="backend='cuda'; valid: auto, torch, triton"):
        quantmla.QuantizedLatentCache(cfg, backend="cuda")
    with pytest.raises(ValueError, match="no FP8 path"):
        quantmla.QuantizedLatentCache(cfg, scheme="fp8", backend="triton")


def test_auto_uses_torch_on_cpu_float32():
    m, tok = quantmla.load()
    quantmla.enable_latent_attention(m)
    cache = quantmla.QuantizedLatentCache(m.config, scheme="c4r4")
    with torch.no_grad():
        m(torch.tensor([[5, 6, 7]]), use_cache=True, **cache_kwargs(cache))
    assert set(cache.backends_used()) == {"torch"}
