"""The one-forward decode-cache simulation equals token-by-token decoding through the real cache."""

import pytest
import torch

from quantmla import QuantizedLatentCache, enable_latent_attention
from quantmla.eval import simulated_decode
from quantmla.models.compat import cache_kwargs
from tiny_models import tiny_model


def _fast_and_slow(model, ids, scheme, sink, recent):
    with torch.no_grad():
        with simulated_decode(model, scheme, sink=sink, recent=recent):
            fast = model(ids, use_cache=False).logits
        cache = QuantizedLatentCache(model.config, scheme=scheme, sink=sink, recent=recent)
        steps = [model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits for t in range(ids.shape[1])]
    return fast, torch.cat(steps, dim=1)


@pytest.mark.parametrize(
    "name,scheme,sink,recent",
    [
        ("deepseek_v3", "c2r4", 2, 5),
        ("deepseek_v3", "c4r4", 0, 0),
        ("longcat_flash", "c3r4", 3, 1),
        ("deepseek_v2", "fp8", 1, 4),
        ("glm4_moe_lite", "c4r8", 4, 8),
        ("deepseek_v3", "bf16", 4, 8),
    ],
)
def test_simulation_equals_token_by_token_decode(name, scheme, sink, recent):
    model = enable_latent_attention(tiny_model(name, dtype=torch.float64))
    ids = torch.randint(3, 256, (2, 29))
    fast, slow = _fast_and_slow(model, ids, scheme, sink, recent)
    # transformers computes RoPE angles in float32, so even unquantised decode and prefill differ
    # slightly for some configs (~5e-9 here); the simulation may not differ by more than that noise
    f16, s16 = _fast_and_slow(model, ids, "bf16", sink, recent)
    rope_noise = (f16 - s16).abs().max().item()
    assert (fast - slow).abs().max().item() <= 1e-10 + 4 * rope_noise
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    if scheme != "bf16":  # the simulation really quantises
        assert (fast - plain).abs().max().item() > 1e-6
    else:
        assert (fast - plain).abs().max().item() <= 1e-10


def test_simulation_refuses_a_cache():
    model = enable_latent_attention(tiny_model("deepseek_v3", dtype=torch.float64))
    cache = QuantizedLatentCache(model.config, scheme="c4r4")
    with simulated_decode(model, "c4r4"), pytest.raises(ValueError, match="use_cache=False"):
        model(torch.randint(3, 256, (1, 4)), **cache_kwargs(cache), use_cache=True)
        model(torch.randint(3, 256, (1, 1)), **cache_kwargs(cache), use_cache=True)


def test_simulation_is_switched_off_after_the_block():
    model = enable_latent_attention(tiny_model("deepseek_v3", dtype=torch.float64))
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
        with simulated_decode(model, "c2r4", sink=0, recent=0):
            model(ids, use_cache=False)
        assert torch.equal(model(ids).logits, before)
