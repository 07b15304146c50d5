"""Block-GTQ's RoPE block scores: measured where latent attention reads the queries and keys, without
changing the model's output."""

import pytest
import torch

from quantmla import QuantizedLatentCache, enable_latent_attention
from quantmla.calibrate.rope_energy import rope_block_scores
from quantmla.models.adapter import get_adapter
from quantmla.models.compat import cache_kwargs
from quantmla.quant.allocate import block_energy
from tiny_models import tiny_model


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_key_scores_are_the_cached_keys_block_energies(name):
    model = enable_latent_attention(tiny_model(name, dtype=torch.float64))
    ids = torch.randint(3, 256, (3, 17))
    scores = rope_block_scores(model, ids, batch_size=2, keys_only=True)
    cache = QuantizedLatentCache(model.config, scheme="bf16")
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(cache))
    d_r = cache.layers[0].values.shape[-1]
    pairs = get_adapter(model.config).rope_layout(model.config).cache_pairs(d_r)
    for idx, layer in enumerate(cache.layers):
        assert torch.allclose(scores[idx], block_energy(layer.values, pairs), rtol=1e-10, atol=0)


def test_query_and_key_score_and_the_output_unchanged():
    model = enable_latent_attention(tiny_model("deepseek_v3", dtype=torch.float64))
    ids = torch.randint(3, 256, (2, 13))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    keys = rope_block_scores(model, ids, keys_only=True)
    both = rope_block_scores(model, ids)
    with torch.no_grad():
        after = model(ids, use_cache=False).logits
    assert torch.equal(ref, after)  # the probes are removed afterwards
    for idx in keys:
        queries = 2 * both[idx] - keys[idx]  # E||q_i||^2 over every head and token
        assert (queries > 0).all() and not torch.allclose(queries, keys[idx])


def test_bad_windows_are_refused():
    model = tiny_model("deepseek_v3", dtype=torch.float64)
    with pytest.raises(ValueError, match="windows"):
        rope_block_scores(model, torch.zeros(0, 5, dtype=torch.long))
