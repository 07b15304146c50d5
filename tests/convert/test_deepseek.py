"""The DeepSeek export: equal to the converted layers (before the latent norm) wherever the format can hold them,
loadable by transformers and by quantmla, and refused where it cannot hold the choice."""

import copy

import pytest
import torch
from conversion_models import tiny, token_batches
from transformers import AutoModelForCausalLM

from quantmla.convert import ConvertConfig, convert, save, to_deepseek
from quantmla.convert.api import check_conversion
from quantmla.convert.partial import install_latent


class ExactLinearNorm(torch.nn.Module):
    """The limit of a norm made linear (its input far below eps): ``x * weight / sqrt(eps)``, in float64."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return x * self.weight / self.eps**0.5


def export_vs_latent(model, cfg, exact_norms=True):
    """Max |logit difference| of the DeepSeek export against the converted layers in the source model. With
    ``exact_norms`` the export's linear norms run as their float64 limit (transformers' RMSNorm computes in float32)."""
    ids = token_batches()
    conv = convert(model, cfg, ids, progress=False)
    ds = to_deepseek(model, conv, torch.float64).eval()
    latent = copy.deepcopy(model)
    install_latent(latent, conv.shape, conv.layers, conv.latent_norm_gains())
    if exact_norms:
        for layer in ds.model.layers:
            attn = layer.self_attn
            if cfg.latent_norm == "linear":
                attn.kv_a_layernorm = ExactLinearNorm(attn.kv_a_layernorm)
            if getattr(attn, "q_a_layernorm", None) is not None and not any(
                la.q_gain is not None for la in conv.layers
            ):
                attn.q_a_layernorm = ExactLinearNorm(attn.q_a_layernorm)
    with torch.no_grad():
        return (ds(ids).logits - latent(ids).logits).abs().max().item(), conv, ds


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe_plain"])
@pytest.mark.parametrize("r,rank", [(1, 6), (4, 20)])
def test_one_kv_head_exports_exactly(family, r, rank):
    """MQA: DeepSeek's one RoPE key is the source's; the interleaved pair order, the query rows, the biases (Qwen2's
    query bias through a linear q_a_layernorm, its key/value biases in the latent's) and the experts (Qwen3-MoE
    through DeepSeek-V2's softmax router) all exact."""
    if family == "qwen3_moe_plain":  # q_norm/k_norm set to identity: the query path is then exact too
        model = tiny("qwen3_moe", 4, 1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
                layer.self_attn.q_norm.variance_epsilon = layer.self_attn.k_norm.variance_epsilon = 0.0
                # identical query heads: every head's RMS is the RMS over all heads
                w = layer.self_attn.q_proj.weight
                w.copy_(w[:16].repeat(4, 1))
    else:
        model = tiny(family, 4, 1)
    err, conv, ds = export_vs_latent(model, ConvertConfig(rope_pairs=r, latent_rank=rank, damping=0.0,
                                                          knorm="gain-only"))  # fmt: skip
    # the query path through DeepSeek's q_a_layernorm and both models' routers compute in float32 in transformers
    assert err < (1e-5 if family.startswith("qwen3_moe") else 1e-10), err
    assert ds.config.model_type == ("deepseek_v2" if family.startswith("qwen3_moe") else "deepseek_v3")
    assert ds.config.qk_rope_head_dim == 2 * r and ds.config.kv_lora_rank == rank


def test_kv_heads_with_proportional_rope_keys_share_one_key_exactly():
    """The shared RoPE key is each pair's principal component over the KV heads: exact when the heads' RoPE rows
    are multiples of one another (and the query rows take the multiples)."""
    model = tiny("llama", 4, 2)
    with torch.no_grad():
        for layer in model.model.layers:
            wk = layer.self_attn.k_proj.weight
            wk[16:].copy_(-2.5 * wk[:16])
    err, _, _ = export_vs_latent(model, ConvertConfig(rope_pairs=2, latent_rank=24, damping=0.0))
    assert err < 1e-10, err


def test_independent_kv_heads_lose_rope_energy_in_the_shared_key():
    model = tiny("llama", 4, 2)
    err, _, _ = export_vs_latent(model, ConvertConfig(rope_pairs=2, latent_rank=24, damping=0.0))
    assert err > 1e-4  # the approximation is real: the test above is not vacuous


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_norms_made_linear_match_their_limit(family):
    """The export as transformers runs it (float32 norms, the linear ones within their epsilon) against the
    converted layers: the norms' float32 rounding and the linear norms' residual (~5e-7 relative) only."""
    err, _, _ = export_vs_latent(tiny(family, 4, 1), ConvertConfig(rope_pairs=2, latent_rank=12), exact_norms=False)
    assert err < 1e-5, err


def test_a_kept_latent_rmsnorm_has_the_latent_rms_over_the_calibration_tokens_as_gain():
    model = tiny("llama", 4, 1)
    cfg = ConvertConfig(rope_pairs=2, latent_rank=12, latent_norm="rms")
    err, conv, ds = export_vs_latent(model, cfg)
    assert err < 1e-5  # transformers' RMSNorm computes in float32
    seen = []
    handle = model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["hidden_states"]), with_kwargs=True
    )
    with torch.no_grad():
        model(token_batches())
    handle.remove()
    c = torch.cat(seen).reshape(-1, 64) @ conv.layers[1].down.T
    gain = ds.model.layers[1].self_attn.kv_a_layernorm.weight
    assert torch.allclose(gain, c.pow(2).mean().sqrt().expand(12), rtol=1e-12)


def test_saved_export_loads_in_transformers_and_quantmla(tmp_path):
    from quantmla.models.adapter import get_adapter
    from quantmla.models.loading import load

    model = tiny("qwen3", 4, 2)
    conv = convert(model, ConvertConfig(rope_pairs=2, latent_rank=24), token_batches(), progress=False)
    ds = to_deepseek(model, conv, torch.float32)
    from quantmla.models.loading import load_tokenizer

    written = save(ds, conv, tmp_path / "mla", tokenizer=load_tokenizer("builtin:tiny-mla"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    ids = token_batches()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ds.eval()(ids).logits)
    assert written.record["cache_elements"] == {"converted": 28, "source": 64, "share": 28 / 64}
    q, _ = load(str(tmp_path / "mla"), dtype="float32")
    assert get_adapter(q.config).dims(q.config).kv_lora_rank == 24


@pytest.mark.parametrize("cfg,match", [
    (dict(rope="contribution"), "rope='contribution' keeps different pairs per KV head"),
    (dict(rope_pairs=8), "needs at least one NoPE pair; valid: 1 .. 7"),
])  # fmt: skip
def test_what_deepseek_cannot_hold_is_refused_before_work(cfg, match):
    model = tiny("llama", 4, 2)
    with pytest.raises(ValueError, match=match):
        check_conversion(model.config, ConvertConfig(**({"rope_pairs": 2, "latent_rank": 8} | cfg)))


@pytest.mark.parametrize("family,overrides,match", [
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_type='linear'"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("llama", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3_moe", dict(norm_topk_prob=True), "norm_topk_prob=True"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "mlp_only_layers"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding-window"),
])  # fmt: skip
def test_sources_we_do_not_convert_exactly_are_refused(family, overrides, match):
    model = tiny(family, 4, 2, **overrides)
    with pytest.raises(ValueError, match=match):
        check_conversion(model.config, ConvertConfig(rope_pairs=2, latent_rank=8))


def test_other_families_are_refused_with_the_valid_ones():
    from transformers import DeepseekV3Config

    with pytest.raises(ValueError, match="model_type='deepseek_v3' .* valid: llama, qwen2, qwen3, qwen3_moe"):
        check_conversion(DeepseekV3Config(), ConvertConfig(rope_pairs=2, latent_rank=8))
