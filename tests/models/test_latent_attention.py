"""The absorbed latent path must reproduce transformers' own MLA forward (METHOD.md section 1)."""

import copy

import pytest
import torch
from transformers import DynamicCache

from quantmla import QuantizedLatentCache, disable_latent_attention, enable_latent_attention
from quantmla.models import is_latent_attention_enabled
from quantmla.models.compat import cache_kwargs
from tiny_models import TINY_CONFIGS, tiny_model

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
NAMES = sorted(TINY_CONFIGS)


def _pair(name, dtype):
    ref = tiny_model(name, dtype=dtype)
    lat = enable_latent_attention(copy.deepcopy(ref))
    return ref, lat


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_match_transformers(name, dtype):
    ref, lat = _pair(name, dtype)
    ids = torch.randint(3, 256, (2, 17))
    with torch.no_grad():
        a, b = ref(ids).logits, lat(ids).logits
        assert (a - b).abs().max().item() <= TOL[dtype]
        # token by token through the caches: transformers' DynamicCache vs our latent cache
        ref_cache = DynamicCache(config=ref.config)
        our_cache = QuantizedLatentCache(lat.config, scheme="bf16")
        for t in range(ids.shape[1]):
            la = ref(ids[:, t : t + 1], **cache_kwargs(ref_cache), use_cache=True).logits
            lb = lat(ids[:, t : t + 1], **cache_kwargs(our_cache), use_cache=True).logits
            assert (la - lb).abs().max().item() <= TOL[dtype], t
            # decode agrees with prefill as closely as transformers' own decode does (DeepSeek-V2
            # rotates in float32 complex numbers, so its decode and prefill differ by ~1e-7)
            own_gap = (la[:, 0] - a[:, t]).abs().max().item()
            assert (lb[:, 0] - a[:, t]).abs().max().item() <= own_gap + TOL[dtype]
    assert our_cache.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_left_padding_batch3(name):
    ref, lat = _pair(name, torch.float64)
    ids = torch.randint(3, 256, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids[mask == 0] = ref.config.pad_token_id
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = ref.generate(**kw)
    assert torch.equal(lat.generate(**kw), expected)
    cache = QuantizedLatentCache(lat.config, scheme="bf16")
    assert torch.equal(lat.generate(**kw, **cache_kwargs(cache)), expected)


def test_quantized_cache_generation_runs_and_differs_from_bf16():
    _, lat = _pair("deepseek_v3", torch.float32)
    ids = torch.randint(3, 256, (2, 40))
    kw = dict(input_ids=ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    out_bf16 = lat.generate(**kw, **cache_kwargs(QuantizedLatentCache(lat.config, scheme="bf16")))
    out_c2 = lat.generate(**kw, **cache_kwargs(QuantizedLatentCache(lat.config, scheme="c2r4", sink=0, recent=0)))
    assert out_c2.shape == out_bf16.shape
    assert not torch.equal(out_c2, out_bf16)  # 2-bit with no windows on a random model does change tokens


def test_disable_restores_the_original_path():
    ref, lat = _pair("longcat_flash", torch.float64)
    assert is_latent_attention_enabled(lat)
    disable_latent_attention(lat)
    assert not is_latent_attention_enabled(lat)
    assert lat.config._attn_implementation == ref.config._attn_implementation
    ids = torch.randint(3, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, lat(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_cache_is_lossless_in_bf16(name):
    """In bf16 the latent path with our bf16 cache gives exactly the tokens of transformers' DynamicCache."""
    lat = enable_latent_attention(tiny_model(name, dtype=torch.bfloat16))
    ids = torch.randint(3, 256, (3, 10))
    kw = dict(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = lat.generate(**kw, **cache_kwargs(DynamicCache(config=lat.config)))
    got = lat.generate(**kw, **cache_kwargs(QuantizedLatentCache(lat.config, scheme="bf16")))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", NAMES)
def test_float32_generation_matches_transformers(name):
    ref, lat = _pair(name, torch.float32)
    ids = torch.randint(3, 256, (3, 10))
    kw = dict(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    cache = QuantizedLatentCache(lat.config, scheme="bf16")
    assert torch.equal(lat.generate(**kw, **cache_kwargs(cache)), ref.generate(**kw))
