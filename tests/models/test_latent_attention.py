"""The absorbed latent path must reproduce transformers' own MLA forward (METHOD.md section 1)."""

import copy

import pytest
import torch
from transformers import DynamicCache

from quantmla import QuantizedLatentCache, disable_latent_attention, enable_latent_attention
from quantmla.measure.simulate import simulated_decode
from quantmla.models import ATTN_IMPLEMENTATION, is_latent_attention_enabled
from quantmla.models.compat import cache_kwargs
from tiny_models import TINY_CONFIGS, tiny_model

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
NAMES = sorted(TINY_CONFIGS)
SOFTMAX_TOL = 1e-6  # some families' eager reference takes its softmax in float32 (seen: 7.7e-8)
DROPOUT_TOL = 1e-5  # the same, carried through a training forward (logits, gradients relative to their largest)


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


@pytest.mark.parametrize("name", NAMES)
def test_switching_the_implementation_after_enable_follows_it(name):
    """set_attn_implementation / a config write after enable: stock attention gets expanded K and V again."""
    ref, lat = _pair(name, torch.float64)
    ids = torch.randint(3, 256, (2, 9))
    with torch.no_grad():
        latent = lat(ids).logits
        for impl in ("sdpa", "eager"):
            ref.set_attn_implementation(impl)
            lat.set_attn_implementation(impl)
            assert (lat(ids).logits - ref(ids).logits).abs().max().item() <= 1e-10, impl
        lat.config._attn_implementation = "sdpa"  # a plain config write, as transformers' tests do
        ref.set_attn_implementation("sdpa")
        assert (lat(ids).logits - ref(ids).logits).abs().max().item() <= 1e-10
        # generation through our bf16 cache under stock sdpa (the cache hands back the latent; sdpa expands it)
        kw = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        cache = QuantizedLatentCache(lat.config, scheme="bf16")
        assert torch.equal(lat.generate(**kw, **cache_kwargs(cache)), ref.generate(**kw))
        lat.set_attn_implementation(ATTN_IMPLEMENTATION)
        assert is_latent_attention_enabled(lat)
        assert torch.equal(lat(ids).logits, latent)


@pytest.mark.parametrize("name", NAMES)
def test_output_attentions_returns_the_probabilities(name):
    ref, lat = _pair(name, torch.float64)
    ref.set_attn_implementation("eager")
    ids = torch.randint(3, 256, (2, 7))
    with torch.no_grad():
        want = ref(ids, output_attentions=True).attentions
        got = lat(ids, output_attentions=True).attentions
        assert len(got) == len(want) > 0
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            assert (a - b).abs().max().item() <= SOFTMAX_TOL
        # a decode step through our cache: the new query's probabilities over every cached token
        cache, ref_cache = QuantizedLatentCache(lat.config, scheme="bf16"), DynamicCache(config=ref.config)
        lat(ids, **cache_kwargs(cache), use_cache=True)
        ref(ids, **cache_kwargs(ref_cache), use_cache=True)
        nxt = torch.randint(3, 256, (2, 1))
        got = lat(nxt, **cache_kwargs(cache), use_cache=True, output_attentions=True).attentions
        want = ref(nxt, **cache_kwargs(ref_cache), use_cache=True, output_attentions=True).attentions
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape == (2, lat.config.num_attention_heads, 1, 8)
            assert (a - b).abs().max().item() <= SOFTMAX_TOL


@pytest.mark.parametrize("name", NAMES)
def test_assisted_decoding_matches_transformers(name):
    """transformers' assisted generation (a draft model, cache cropping) with latent attention enabled."""
    ref, lat = _pair(name, torch.float64)
    assistant = copy.deepcopy(ref)
    ids = torch.randint(3, 256, (1, 8))
    kw = dict(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = ref.generate(**kw)
    assert torch.equal(lat.generate(**kw, assistant_model=assistant), expected)
    assert torch.equal(lat.generate(**kw, assistant_model=enable_latent_attention(assistant)), expected)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_static_cache_generate_compiles_to_one_full_graph(name):
    """transformers' ``test_generate_compile_model_forward_fullgraph``, compiled half, on latent attention: generate
    with ``cache_implementation="static"`` compiles the decode forward with ``fullgraph=True, dynamic=False`` (a graph
    break or a dynamic shape is an error), gives transformers' own greedy tokens, and a second input of the same shape
    runs without recompiling (``fail_on_recompile``)."""
    from transformers import CompileConfig

    ref = tiny_model(name, experts_implementation=None)  # float32: the default grouped experts take no float64
    lat = enable_latent_attention(copy.deepcopy(ref))
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # compile on CPU too, as transformers' test does
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    inputs = [torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    torch.compiler.reset()
    try:
        for i, ids in enumerate(inputs):
            mask = torch.ones_like(ids)
            expected = ref.generate(input_ids=ids, attention_mask=mask, **kw)
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                out = lat.generate(input_ids=ids, attention_mask=mask, cache_implementation="static",
                                   compile_config=config, **kw)  # fmt: skip
            assert torch.equal(out, expected), i
            assert hasattr(lat, "_compiled_call")  # the forward ran compiled
    finally:
        torch.compiler.reset()


@pytest.mark.parametrize("name", NAMES)
def test_attention_dropout_in_training_drops_as_eager_does(name):
    """Training with attention dropout (transformers' training tests run with it): the same probabilities dropped
    as transformers' eager attention for the same seed, so logits and gradients equal eager's in float64; a
    quantised decode path refuses dropout with one message."""
    ref, lat = _pair(name, torch.float64)
    ref.set_attn_implementation("eager")
    for model in (ref, lat):
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.4
        model.train()
    ids = torch.randint(3, 256, (2, 11))
    grads = []
    for model in (ref, lat):
        model.zero_grad()
        torch.manual_seed(7)
        logits = model(ids).logits
        logits.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        if model is ref:
            want = logits.detach()
    assert (logits.detach() - want).abs().max().item() <= DROPOUT_TOL
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max().item() <= DROPOUT_TOL * a.abs().max().item()
    lat.eval()
    with torch.no_grad():  # the dropout was active: evaluation mode (no dropout) gives other logits
        assert (lat(ids).logits - want).abs().max().item() > 1e-3
    lat.train()
    with simulated_decode(lat, "c4r4"), pytest.raises(NotImplementedError, match="attention dropout"):
        lat(ids)  # the decode-cache simulation attends without dropout: refused, not silently undropped
