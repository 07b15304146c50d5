"""Fused transforms cost nothing at full precision: float64 logits unchanged, for every family.

transformers' RMSNorm computes in float32 even in a float64 model, and DeepSeek-V2's RoPE multiplies in
complex64; both round the *transformed* tensors differently (~1e-6 in the logits). The exactness test
therefore gives the latent norms a float64 forward (on the test's instances only), and checks
DeepSeek-V2's RoPE transform against a bound derived from float32 rounding.
"""

import copy
import types

import pytest
import torch
from transformers import DynamicCache

from quantmla import enable_latent_attention
from quantmla.models import get_adapter
from quantmla.models.compat import cache_kwargs
from quantmla.transforms import ContentTransform, RopeTransform, fuse_transforms, original_basis, random_orthogonal
from tiny_models import TINY_CONFIGS, tiny_model


def _random_transforms(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    adapter = get_adapter(model)
    dims = adapter.dims(model.config)
    content, rope = {}, {}
    for idx, _ in adapter.attention_modules(model):
        content[idx] = ContentTransform(
            random_orthogonal(dims.kv_lora_rank, g),
            torch.exp(0.5 * torch.randn(dims.kv_lora_rank, generator=g).double()),
        )
        rope[idx] = RopeTransform(
            torch.rand(dims.rope_dim // 2, generator=g).double() * 6.28,
            0.5 * torch.randn(dims.rope_dim // 2, generator=g).double(),
        )
    return content, rope


def _float64_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _exact_norms(model):
    adapter = get_adapter(model)
    for _, attn in adapter.attention_modules(model):
        norm = adapter.kv_norm(attn)
        norm.forward = types.MethodType(_float64_norm, norm)
    return model


FLOAT32_ROPE = {"deepseek_v2", "deepseek_v2_noqlora_yarn"}  # complex64 rotation inside transformers


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_fused_model_has_identical_logits(name):
    ref = _exact_norms(tiny_model(name, dtype=torch.float64))
    content, rope = _random_transforms(ref)
    if name in FLOAT32_ROPE:
        rope = {}
    fused = fuse_transforms(_exact_norms(copy.deepcopy(ref)), content, rope)
    ids = torch.randint(3, 256, (2, 19))
    with torch.no_grad():
        a, b = ref(ids).logits, fused(ids).logits
        assert (a - b).abs().max().item() <= 1e-9
        # and through the latent path, which reads the transformed cache
        lat = enable_latent_attention(_exact_norms(copy.deepcopy(fused)))
        assert (lat(ids).logits - a).abs().max().item() <= 1e-9
    # the weights really changed
    w0 = next(get_adapter(ref).attention_modules(ref))[1].kv_b_proj.weight
    w1 = next(get_adapter(fused).attention_modules(fused))[1].kv_b_proj.weight
    assert (w0 - w1).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(FLOAT32_ROPE))
def test_float32_rope_family_within_float32_rounding(name):
    ref = tiny_model(name, dtype=torch.float64)
    content, rope = _random_transforms(ref)
    fused = fuse_transforms(copy.deepcopy(ref), content, rope)
    ids = torch.randint(3, 256, (2, 19))
    with torch.no_grad():
        a, b = ref(ids).logits, fused(ids).logits
    # float32 rounding of the rotated query/key and of the norm: 64 float32 ulps of the logit scale
    assert (a - b).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * a.abs().max().item()


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "longcat_flash"])
def test_cached_tensors_are_transformed(name):
    ref = _exact_norms(tiny_model(name, dtype=torch.float64))
    content, rope = _random_transforms(ref, seed=1)
    fused = fuse_transforms(_exact_norms(copy.deepcopy(ref)), content, rope)
    adapter = get_adapter(ref)
    ids = torch.randint(3, 256, (1, 7))
    caches = []
    for m in (ref, fused):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(ids, use_cache=True, **cache_kwargs(cache))
        caches.append(cache)
    layout = adapter.rope_layout(ref.config)
    cp = layout.cache_pairs(64)
    for idx, attn in adapter.attention_modules(ref):
        g = adapter.kv_norm(attn).weight.double() * adapter.latent_scale(attn)
        c, c2 = caches[0].layers[idx].keys[:, 0], caches[1].layers[idx].keys[:, 0]
        t = content[idx]
        expect = c / g @ t.rotation @ torch.diag(t.scales) * adapter.latent_scale(attn)
        # DeepSeek-V2: the float32 RoPE of earlier layers already perturbs this layer's input (~1e-6)
        tol = 1e-5 if name in FLOAT32_ROPE else 1e-9
        assert torch.allclose(c2, expect, atol=tol)
        k, k2 = caches[0].layers[idx].values[:, 0], caches[1].layers[idx].values[:, 0]
        assert torch.allclose(k2, k @ rope[idx].matrix(cp), atol=tol)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_original_basis_is_the_identity_of_the_cache(name):
    """R = diag(sign g), S = |g| (g with negative entries): float64 logits equal to 1e-12, the cached latent
    bit-identical to the untouched model's, kv_b_proj bit-identical; R = I, S = 1 does change the cache."""
    ref = _exact_norms(tiny_model(name, dtype=torch.float64))
    adapter = get_adapter(ref)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, attn in adapter.attention_modules(ref):
            w = adapter.kv_norm(attn).weight
            gain = torch.exp(0.8 * torch.randn(w.shape, generator=g, dtype=torch.float64))
            gain[::3] *= -1
            w.copy_(gain)
    modules = dict(adapter.attention_modules(ref))
    fused = fuse_transforms(
        _exact_norms(copy.deepcopy(ref)), {i: original_basis(adapter.kv_norm(a).weight) for i, a in modules.items()}
    )
    unit = fuse_transforms(
        _exact_norms(copy.deepcopy(ref)),
        {i: ContentTransform(torch.eye(a.kv_lora_rank).double(), torch.ones(a.kv_lora_rank).double())
         for i, a in modules.items()},
    )  # fmt: skip
    ids = torch.randint(3, 256, (2, 19))
    caches = []
    with torch.no_grad():
        logits = ref(ids).logits
        assert (fused(ids).logits - logits).abs().max().item() <= 1e-12
        for m in (ref, fused, unit):
            cache = DynamicCache(config=m.config)
            m(ids, use_cache=True, **cache_kwargs(cache))
            caches.append(cache)
    for idx, attn in modules.items():
        c, c_fused, c_unit = (cache.layers[idx].keys for cache in caches)
        assert torch.equal(c_fused, c), idx  # the cache is the untouched model's c
        assert not torch.allclose(c_unit, c, atol=1e-3)  # while R = I, S = 1 caches c / g
        f_attn = dict(get_adapter(fused).attention_modules(fused))[idx]
        assert torch.equal(f_attn.kv_b_proj.weight, attn.kv_b_proj.weight)


def test_bad_transforms():
    with pytest.raises(ValueError, match="not orthogonal"):
        ContentTransform(torch.randn(8, 8).double(), torch.ones(8).double())
    with pytest.raises(ValueError, match="positive"):
        ContentTransform(torch.eye(8).double(), -torch.ones(8).double())
    m = tiny_model("deepseek_v3", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"latent gain is 0 in channels \[2\]"):
        original_basis(torch.tensor([1.0, -2.0, 0.0]))
    with pytest.raises(ValueError, match="no attention module with cache index 9"):
        fuse_transforms(m, content={9: ContentTransform(torch.eye(128).double(), torch.ones(128).double())})


@pytest.mark.parametrize("d", [8, 64, 512])
def test_the_polar_factor_is_the_svds_on_nearly_orthogonal_matrices(d):
    from quantmla.transforms.fuse import polar_factor

    g = torch.Generator().manual_seed(d)
    a = torch.randn(d, d, generator=g, dtype=torch.float64) * 0.02
    r = torch.linalg.matrix_exp(a - a.T) + 1e-9 * torch.randn(d, d, generator=g, dtype=torch.float64)  # rounding
    p = polar_factor(r)
    u, _, vh = torch.linalg.svd(r)
    assert torch.allclose(p, u @ vh, atol=1e-12, rtol=0)
    assert torch.allclose(p.T @ p, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
