"""The pytest plugin that runs transformers' DeepSeek-V2/V3 model tests through quantmla (scripts/quantmla_hf_suite.py),
on models shaped like those tests' tiny models (latent 16 / 32, RoPE 16 / 64)."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from quantmla import QuantizedLatentCache
from quantmla.models.compat import output_cache
from quantmla.models.latent import ATTN_IMPLEMENTATION, is_latent_attention_enabled, module_state
from script_modules import load_script

_COMMON = dict(vocab_size=99, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
               first_k_dense_replace=1, pad_token_id=0)  # fmt: skip
MODELS = {
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(
        DeepseekV2Config(**_COMMON, kv_lora_rank=32, q_lora_rank=16, qk_nope_head_dim=64, qk_rope_head_dim=64)
    ),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **_COMMON,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_group=2,
            topk_group=1,
        )  # fmt: skip
    ),
}


@pytest.fixture
def plugin(monkeypatch):
    mod = load_script("scripts/quantmla_hf_suite.py")
    monkeypatch.setenv("QUANTMLA_HF_SINK", "0")
    monkeypatch.setenv("QUANTMLA_HF_RECENT", "0")
    undo = mod.install()
    yield mod
    undo()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_models_get_latent_attention_and_generate_gets_the_quantised_cache(plugin, family):
    model = MODELS[family]().eval()
    assert is_latent_attention_enabled(model)
    ids = torch.randint(3, 99, (2, 7))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = output_cache(out)
    assert isinstance(cache, QuantizedLatentCache) and cache.get_seq_length() == 10
    group = {"deepseek_v2": 32, "deepseek_v3": 16}[family]  # the largest dividing the latent and RoPE dims
    assert cache.cache_config.sink == 0 and cache.cache_config.group_size == group
    lookup = model.generate(ids[:1], max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3)
    greedy = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert lookup.shape == greedy.shape == (1, 13)


def test_an_implementation_asked_for_by_name_is_kept_with_latent_attention_installed(plugin):
    config = MODELS["deepseek_v3"]().config
    config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(config)
    assert model.config._attn_implementation == "eager"
    assert all(module_state(layer.self_attn) is not None for layer in model.model.layers)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert is_latent_attention_enabled(model)


def test_undo_restores_transformers(plugin):
    plugin_undo = plugin.install()
    plugin_undo()
    assert is_latent_attention_enabled(MODELS["deepseek_v3"]())  # the fixture's patch is still on
