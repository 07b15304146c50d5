"""The latent embedded by an orthogonal map computes the same function (float64), and the 576 builtin."""

import types

import pytest
import torch

from quantmla.models.embed import embed_latent
from tiny_models import tiny_model


def _float64_norm(self, x):  # transformers' RMSNorm computes in float32
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _exact_norms(model):
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_float64_norm, mod)
    return model


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
def test_embedded_latent_is_exact_in_float64(name):
    model = tiny_model(name, dtype=torch.float64)
    wide = embed_latent(model, kv_lora_rank=4 * model.config.kv_lora_rank)
    assert wide.config.kv_lora_rank == 4 * model.config.kv_lora_rank
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    a, b = _exact_norms(model)(ids).logits, _exact_norms(wide)(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-9


def test_embedding_needs_a_wider_latent_and_a_plain_norm():
    with pytest.raises(ValueError, match="only widens"):
        embed_latent(tiny_model("deepseek_v3"), kv_lora_rank=64)
    with pytest.raises(ValueError, match="valid: deepseek_v2, deepseek_v3"):
        embed_latent(tiny_model("longcat_flash"), kv_lora_rank=512)


def test_builtin_576_is_the_bundled_model(tmp_path, monkeypatch):
    import quantmla

    monkeypatch.setenv("QUANTMLA_CACHE", str(tmp_path))
    wide, tok = quantmla.load("builtin:tiny-mla-576", dtype="float32")
    base, _ = quantmla.load(dtype="float32")
    assert (wide.config.kv_lora_rank, wide.config.tie_word_embeddings) == (512, False)
    ids = tok("int main(void) { return 0; }", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = base(ids).logits, wide(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
