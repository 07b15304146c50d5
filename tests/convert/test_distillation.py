"""Distillation trains the converted model's attention and norms toward the source, nothing else."""

import itertools

import pytest
import torch
from conversion_models import tiny, token_batches

from quantmla.convert import ConvertConfig, DistillConfig, convert, distill_conversion, function_kl, to_deepseek
from quantmla.convert.deepseek import LinearNorm, fold_linear_norms, unfold_linear_norms
from quantmla.convert.distillation import trainable_names


def test_distillation_lowers_the_kl_and_trains_only_attention_and_norms():
    teacher = tiny("qwen3", 4, 2).float()
    ids = token_batches(n=4)
    conv = convert(teacher, ConvertConfig(rope_pairs=1, latent_rank=8), ids, progress=False)
    student = to_deepseek(teacher, conv, torch.float32)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    held_out = ids  # the loss it optimises
    kl0 = function_kl(teacher, student, held_out)
    batches = itertools.cycle(ids.split(2))
    curve = distill_conversion(
        student, teacher, conv, batches, DistillConfig(steps=30, lr=1e-2, warmup=2), progress=False
    )
    kl1 = function_kl(teacher, student, held_out)
    assert kl1 < 0.5 * kl0, (kl0, kl1)
    assert curve[0]["step"] == 0 and curve[-1]["step"] == 29 and curve[-1]["tokens"] == 30 * ids[:2].numel()
    trained = set(trainable_names(student, "attention")) | {"model.layers.0.self_attn.kv_a_layernorm.weight"}
    for n, p in student.named_parameters():
        changed = not torch.equal(before[n], p)
        if n in trained:
            assert ".self_attn." in n or "norm" in n
        else:
            assert not changed, n
    assert any(not torch.equal(before[n], dict(student.named_parameters())[n]) for n in trained)
    assert not any("mlp" in n or "embed" in n or "lm_head" in n for n in trained)


@pytest.mark.parametrize("bad", [dict(trainable="mlp"), dict(lr=0.0), dict(steps=-1), dict(log_every=0)])
def test_bad_distillation_settings_are_one_clear_error(bad):
    with pytest.raises(ValueError):
        DistillConfig(**bad)


def test_linear_norms_train_unscaled_and_fold_back_to_stock_rmsnorms():
    model = tiny("qwen2", 4, 2)  # a query bias: q_a_layernorm made linear too
    conv = convert(model, ConvertConfig(rope_pairs=2, latent_rank=16), token_batches(), progress=False)
    ds = to_deepseek(model, conv, torch.float64).eval()
    ids = token_batches(seed=3)
    with torch.no_grad():
        ref = ds(ids).logits
    norms = [type(m) for m in ds.modules()]
    eps = conv.shape.rms_norm_eps
    unfold_linear_norms(ds, conv.layers, "linear", eps)
    attn = ds.model.layers[0].self_attn
    assert isinstance(attn.kv_a_layernorm, LinearNorm) and isinstance(attn.q_a_layernorm, LinearNorm)
    assert attn.kv_a_proj_with_mqa.weight[:16].abs().max() > 1e-2  # unscaled: Adam's steps fit them
    with torch.no_grad():
        assert (ds(ids).logits - ref).abs().max() < 1e-5
    fold_linear_norms(ds, conv.layers, conv.stats, "linear", eps)
    assert [type(m) for m in ds.modules()] == norms
    with torch.no_grad():
        assert (ds(ids).logits - ref).abs().max() < 1e-5
