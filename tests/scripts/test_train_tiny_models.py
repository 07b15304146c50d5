"""The bundled models' training script: both families within their size limits (the MLA model under 20 MB, the GQA
teacher under 8 MB in BF16), the teacher a GQA model with per-head q_norm/k_norm, and its NIAH through the model's
own cache counting every answer once per breakdown."""

import torch
from transformers import AutoModelForCausalLM

from quantmla.models.loading import builtin_path, builtin_text
from script_modules import load_script


def _params(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_both_families_fit_their_size_limits():
    train = load_script("scripts/train_tiny_mla.py")
    mla = train.model_config(8192, 0, 1)
    assert 2 * _params(mla) < 20e6
    for name in ("gqa", "gqa-deep"):
        gqa = train.FAMILIES[name](8192, 0, 1)
        assert 2 * _params(gqa) < 8e6, name
        assert gqa.num_attention_heads > gqa.num_key_value_heads > 1 and gqa.model_type == "qwen3"
        assert gqa.layer_types == ["full_attention"] * gqa.num_hidden_layers
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(gqa)
        assert len(model.model.layers) == gqa.num_hidden_layers
        attn = model.model.layers[0].self_attn
        assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")  # QK-norm: what calibrated KNorm must replace
    assert train.FAMILIES["gqa-deep"](8192, 0, 1).num_hidden_layers == 8


def test_niah_through_the_models_own_cache_counts_each_answer_once():
    from transformers import AutoTokenizer

    train = load_script("scripts/train_tiny_mla.py")
    tok = AutoTokenizer.from_pretrained(builtin_path("tiny-mla"))
    config = train.gqa_config(len(tok), tok.eos_token_id, tok.pad_token_id)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    text = builtin_text("test")[:40000]
    out = train.niah_own_cache(model, tok, text, 1, "heldout")
    assert out["all"]["answers"] == 45  # 3 tasks x 3 lengths x 5 depths
    assert sum(out[t]["answers"] for t in ("niah-1", "niah-2", "niah-3")) == 45
    assert sum(out[n]["answers"] for n in ("1024", "2048", "4096")) == 45


def test_fine_tuning_starts_from_the_same_architecture_only(tmp_path):
    """``--init``: the weights are loaded exactly (equal tensors) and a checkpoint of another shape is refused."""
    import pytest

    train = load_script("scripts/train_tiny_mla.py")
    config = train.gqa_config(512, 0, 1)
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "a")
    model, sha = train.initial_model(config, tmp_path / "a")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32).state_dict()
    assert all(torch.equal(t, saved[k]) for k, t in model.state_dict().items()) and list(sha) == ["model.safetensors"]
    fresh, none = train.initial_model(config, None)
    assert none is None and not torch.equal(fresh.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    config.num_hidden_layers, config.layer_types = 2, ["full_attention"] * 2
    with pytest.raises(RuntimeError, match="layers.1"):
        train.initial_model(config, tmp_path / "a")
