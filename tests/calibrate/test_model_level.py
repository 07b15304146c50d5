"""QuantMLA's model-level stage: the transforms it learns in the original basis are the fused model's."""

import copy
import types

import pytest
import torch

from quantmla import enable_latent_attention
from quantmla.calibrate import CalibrationConfig, calibrate_model
from quantmla.calibrate.model_level import (
    ROTATION_WIDTH,
    InstalledPaths,
    LayerPaths,
    ModelLevelConfig,
    optimizer,
    refine,
)
from quantmla.calibrate.objectives import latent_gain
from quantmla.formats.scheme import parse_scheme
from quantmla.measure.simulate import simulated_decode
from quantmla.models import get_adapter
from quantmla.transforms import ContentTransform, RopeTransform, fuse_transforms, random_orthogonal
from tiny_models import tiny_model


def _float64_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _setup(name):
    model = enable_latent_attention(tiny_model(name, dtype=torch.float64))
    adapter = get_adapter(model)
    for _, attn in adapter.attention_modules(model):  # transformers' RMSNorm computes in float32
        norm = adapter.kv_norm(attn)
        norm.forward = types.MethodType(_float64_norm, norm)
    g = torch.Generator().manual_seed(1)
    dims = adapter.dims(model.config)
    transforms = {
        idx: (
            ContentTransform(
                random_orthogonal(dims.kv_lora_rank, g),
                torch.exp(0.5 * torch.randn(dims.kv_lora_rank, generator=g)).double(),
            ),
            RopeTransform(
                torch.rand(dims.rope_dim // 2, generator=g).double() * 6.28,
                0.5 * torch.randn(dims.rope_dim // 2, generator=g).double(),
            ),
        )
        for idx, _ in adapter.attention_modules(model)
    }
    return model, adapter, transforms


def _layer_paths(model, adapter, modules, transforms) -> dict[int, LayerPaths]:
    return {
        idx: LayerPaths(*transforms[idx], latent_gain(adapter, attn), adapter.rope_layout(model.config).cache_pairs(
            attn.qk_rope_head_dim))
        for idx, attn in modules
    }  # fmt: skip


@pytest.mark.parametrize(
    "name,scheme", [("deepseek_v3", "c4r4"), ("longcat_flash", "c4r4"), ("deepseek_v3", "c2q94r4p8"),
                    ("deepseek_v3", "c4p8r4p4")]
)  # fmt: skip
def test_transforms_in_the_original_basis_equal_the_fused_model(name, scheme):
    """The quantised cache seen through LayerPaths (unfused model) = the fused model's quantised cache, paged
    paths included (their pages start after the sinks)."""
    model, adapter, transforms = _setup(name)
    scheme = parse_scheme(scheme)
    modules = list(adapter.attention_modules(model))
    layers = _layer_paths(model, adapter, modules, transforms)
    ids = torch.randint(3, 256, (2, 40))
    with torch.no_grad():
        with InstalledPaths(modules, layers, scheme, 16, sink=2, recent=8):
            ours = model(ids, use_cache=False).logits
        fused = fuse_transforms(
            copy.deepcopy(model), {i: t[0] for i, t in transforms.items()}, {i: t[1] for i, t in transforms.items()}
        )
        with simulated_decode(fused, scheme, group_size=16, sink=2, recent=8):
            ref = fused(ids, use_cache=False).logits
        with simulated_decode(model, scheme, group_size=16, sink=2, recent=8):
            untransformed = model(ids, use_cache=False).logits
    assert (ours - ref).abs().max().item() <= 1e-9
    assert (untransformed - ref).abs().max().item() > 1e-4  # the transforms change the quantised cache


def test_refine_never_worse_than_its_best_start_and_learns():
    model, adapter, transforms = _setup("deepseek_v3")
    model = model.float()
    modules = list(adapter.attention_modules(model))
    ident = {
        idx: (ContentTransform(torch.eye(t[0].rotation.shape[0]), torch.ones(t[0].scales.shape)),
              RopeTransform(torch.zeros_like(t[1].angles), torch.zeros_like(t[1].angles)))
        for idx, t in transforms.items()
    }  # fmt: skip
    gains = {idx: latent_gain(adapter, attn) for idx, attn in modules}
    pairs = {idx: adapter.rope_layout(model.config).cache_pairs(attn.qk_rope_head_dim) for idx, attn in modules}
    g = torch.Generator().manual_seed(0)
    train, val = torch.randint(3, 256, (8, 32), generator=g), torch.randint(3, 256, (4, 32), generator=g)
    cfg = ModelLevelConfig(steps=6, lr=1e-2, batch_size=2, eval_every=2)
    out, rep = refine(
        model, modules, {"identity": ident, "random": transforms}, gains, pairs, train, val, parse_scheme("c2r4"),
        16, 0, 0, cfg, progress=False,
    )  # fmt: skip
    assert rep["init"] == min(rep["start_val"], key=rep["start_val"].get)
    assert rep["val_after"] <= rep["start_val"][rep["init"]]
    assert [s for s, _ in rep["history"]] == [0, 2, 4, 6]
    assert all(p.requires_grad for p in model.parameters())  # the model's flags are restored
    assert len({v for _, v in rep["history"]}) == 4  # every evaluation saw different parameters
    d = transforms[0][0].rotation.shape[0]
    assert rep["rotation_lr"] == pytest.approx(1e-2 * ROTATION_WIDTH / d)
    start = (transforms if rep["init"] == "random" else ident)[0][1].angles.double()
    assert torch.equal(out[0][1].angles, start) == (rep["best_step"] == 0)


def test_model_level_config_errors():
    with pytest.raises(ValueError, match="valid: kl, ce"):
        ModelLevelConfig(objective="mse")
    with pytest.raises(ValueError, match="lr=0"):
        ModelLevelConfig(lr=0)
    with pytest.raises(ValueError, match="rotation_lr=0"):
        ModelLevelConfig(rotation_lr=0.0)
    with pytest.raises(ValueError, match="rotation_lr=-1"):
        CalibrationConfig(model_rotation_lr=-1.0)


def test_rotation_rate_scales_with_the_width():
    cfg = ModelLevelConfig(lr=2e-3)
    assert cfg.rotation_rate(256) == pytest.approx(2e-3 * ROTATION_WIDTH / 256)
    assert cfg.rotation_rate(512) == pytest.approx(cfg.rotation_rate(256) / 2)
    assert ModelLevelConfig(lr=2e-3, rotation_lr=5e-5).rotation_rate(256) == 5e-5
    # the layer stage does not depend on the model stage's rates: a saved layer stage is reused across them
    assert CalibrationConfig(model_rotation_lr=1e-5).layer_key() == CalibrationConfig().layer_key()
    assert CalibrationConfig(model_rotation_lr=1e-5).model_level().rotation_lr == 1e-5


@pytest.mark.parametrize("trainable", [("content", "rope"), ("rope",), ("content",)])
def test_one_step_moves_the_rotation_by_its_width_scaled_rate(trainable):
    """Adam's first step moves each parameter by its group's rate (m / sqrt(v) = sign(g)): the rotation's generator
    by lr * ROTATION_WIDTH / d, every per-channel parameter by lr; each trainable parameter in exactly one group."""
    model, adapter, transforms = _setup("deepseek_v3")
    modules = list(adapter.attention_modules(model))
    layers = _layer_paths(model, adapter, modules, transforms)
    cfg = ModelLevelConfig(lr=1e-2)
    opt = optimizer(layers, trainable, cfg)
    grouped = [p for g in opt.param_groups for p in g["params"]]
    wanted = [p for lp in layers.values() for path in trainable for p in getattr(lp, path).parameters()]
    assert len(grouped) == len(wanted) and {id(p) for p in grouped} == {id(p) for p in wanted}
    before = {id(p): p.detach().clone() for p in grouped}
    g = torch.Generator().manual_seed(3)
    for p in grouped:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    opt.step()
    d = transforms[0][0].rotation.shape[0]
    for lp in layers.values():
        for path in trainable:
            for name, p in getattr(lp, path).named_parameters():
                rate = cfg.rotation_rate(d) if name == "skew" else cfg.lr
                step = (p.detach() - before[id(p)]).abs()
                assert step.max().item() == pytest.approx(rate, rel=1e-3), (path, name)
    assert ("content" in trainable) == any(g["name"] == "rotation" for g in opt.param_groups)


def test_layer_stage_is_reused_and_checked():
    ids = torch.randint(0, 100, (6, 32), generator=torch.Generator().manual_seed(0))
    cfg = dict(scheme="c4r4", steps=2, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False)
    _, rep = calibrate_model(tiny_model("deepseek_v3"), None, ids, model_steps=2, sink=0, recent=0, **cfg)
    assert rep.model_level["sink"] == 0 and len(rep.model_level["history"]) == 2
    assert all("val_final" in row["content"] for row in rep.layers)
    _, rep2 = calibrate_model(
        tiny_model("deepseek_v3"), None, ids, model_steps=2, sink=4, recent=8, layer_stage=rep.layer_stage, **cfg
    )
    assert rep2.layer_stage is rep.layer_stage and rep2.model_level["recent"] == 8
    with pytest.raises(ValueError, match="different config"):
        calibrate_model(tiny_model("deepseek_v3"), None, ids, layer_stage=rep.layer_stage, **{**cfg, "steps": 3})


def test_model_stage_at_a_longer_context_joins_consecutive_windows(monkeypatch):
    from quantmla.calibrate import api

    seen = []
    original = api.refine

    def spy(model, modules, starts, gains, pairs, train_w, val_w, *args, **kwargs):
        seen.append((train_w.clone(), val_w.clone()))
        return original(model, modules, starts, gains, pairs, train_w, val_w, *args, **kwargs)

    monkeypatch.setattr(api, "refine", spy)
    ids = torch.randint(3, 256, (6, 16))
    cfg = dict(
        scheme="c2r4", steps=1, num_seqs=4, val_seqs=2, seq_len=16, batch_size=2, sink=0, recent=0, progress=False
    )
    _, rep = calibrate_model(tiny_model("deepseek_v3"), None, ids, model_steps=1, model_seq_len=32, **cfg)
    train, val = seen[0]
    assert torch.equal(train, ids[:4].reshape(2, 32)) and torch.equal(val, ids[4:].reshape(1, 32))
    # the layer stage is the one of the 16-token windows: it is reused by a run at the other model length
    calibrate_model(tiny_model("deepseek_v3"), None, ids, model_steps=1, layer_stage=rep.layer_stage, **cfg)
    assert torch.equal(seen[1][0], ids[:4])


@pytest.mark.parametrize("bad", [24, 8, 48])
def test_model_seq_len_must_join_whole_windows(bad):
    with pytest.raises(ValueError, match="model_seq_len"):
        CalibrationConfig(num_seqs=4, val_seqs=2, seq_len=16, model_seq_len=bad)
