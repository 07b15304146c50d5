import math

import pytest
import torch
from transformers import DynamicCache

from quantmla.models import RopeLayout, get_adapter
from quantmla.models.compat import cache_kwargs
from tiny_models import TINY_CONFIGS, tiny_llama, tiny_model


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def model(request):
    return tiny_model(request.param, dtype=torch.float64)


def _capture_inputs(model, ids):
    """Hidden states entering each attention module, and the DynamicCache transformers fills."""
    adapter = get_adapter(model)
    seen, hooks = {}, []
    for idx, attn in adapter.attention_modules(model):
        hooks.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, idx=idx: seen.__setitem__(idx, kw.get("hidden_states", a[0] if a else None)),
                with_kwargs=True,
            )
        )
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    for h in hooks:
        h.remove()
    return seen, cache


def test_roles_reproduce_the_cached_latent_and_rope_pairs(model):
    adapter = get_adapter(model)
    ids = torch.randint(3, 256, (2, 9))
    seen, cache = _capture_inputs(model, ids)
    layout = adapter.rope_layout(model.config)
    dims = adapter.dims(model.config)
    assert len(seen) == adapter.num_cache_layers(model.config) == len(cache.layers)
    for idx, attn in adapter.attention_modules(model):
        x = seen[idx]
        proj = adapter.kv_a_proj(attn)
        y = torch.nn.functional.linear(
            x,
            proj.weight[adapter.latent_rows(attn)],
            None if proj.bias is None else proj.bias[adapter.latent_rows(attn)],
        )
        c = adapter.kv_norm(attn)(y) * adapter.latent_scale(attn)
        cached_c, cached_k = cache.layers[idx].keys[:, 0], cache.layers[idx].values[:, 0]
        assert torch.allclose(c, cached_c, atol=1e-12)
        r = torch.nn.functional.linear(
            x, proj.weight[adapter.rope_rows(attn)], None if proj.bias is None else proj.bias[adapter.rope_rows(attn)]
        )
        wp, cp = layout.weight_pairs(dims.rope_dim), layout.cache_pairs(dims.rope_dim)
        # position 0: RoPE is the identity, only the pair layout moves channels
        assert torch.allclose(r[:, 0, wp], cached_k[:, 0, cp], atol=1e-6)
        # every position: each frequency pair keeps its norm (a rotation of exactly that pair)
        assert torch.allclose(r[..., wp].norm(dim=-1), cached_k[..., cp].norm(dim=-1), rtol=1e-5)


def test_head_roles(model):
    adapter = get_adapter(model)
    dims = adapter.dims(model.config)
    _, attn = next(adapter.attention_modules(model))
    assert adapter.w_uk(attn).shape == (dims.num_heads, dims.nope_dim, dims.kv_lora_rank)
    assert adapter.w_uv(attn).shape == (dims.num_heads, dims.v_dim, dims.kv_lora_rank)
    # the views alias kv_b_proj: writing through them changes the module
    assert adapter.w_uk(attn).data_ptr() == adapter.kv_b_proj(attn).weight.data_ptr()
    x = torch.randn(3, adapter.q_proj(attn).in_features, dtype=torch.float64)
    q = adapter.q_proj(attn)(x).view(3, dims.num_heads, dims.nope_dim + dims.rope_dim)
    rows = adapter.q_rope_rows(attn)
    q_pe = torch.nn.functional.linear(x, adapter.q_proj(attn).weight[rows.flatten()]).view(3, dims.num_heads, -1)
    assert torch.equal(q_pe, q[..., dims.nope_dim :])
    assert adapter.softmax_scale(attn) > 0


def test_yarn_scale_includes_mscale():
    m = tiny_model("deepseek_v3_yarn", dtype=torch.float64)
    adapter = get_adapter(m)
    _, attn = next(adapter.attention_modules(m))
    base = (32 + 64) ** -0.5
    mscale = 0.1 * 1.0 * math.log(4.0) + 1.0
    assert adapter.softmax_scale(attn) == pytest.approx(base * mscale * mscale, rel=1e-12)


def test_rope_layout_pairs():
    assert RopeLayout.pairs(8, True).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert RopeLayout.pairs(8, False).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_non_mla_model_rejected():
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'\).*supported: deepseek_v2"):
        get_adapter(tiny_llama())
