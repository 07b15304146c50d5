"""The conversion's algebra in float64: exact where it is exact (every pair kept, full rank), against an
independent partial-RoPE reference where pairs are dropped, and optimal where it claims to be."""

import copy
import math

import pytest
import torch
from conversion_models import tiny, token_batches

from quantmla.convert.config import ConvertConfig
from quantmla.convert.partial import install_latent
from quantmla.convert.source import decoder_layers, read_attention, source_shape
from quantmla.convert.stats import gather_stats
from quantmla.convert.surgery import choose_pairs, convert_layer, factorise


def converted(model, cfg, ids):
    shape = source_shape(model.config)
    stats = gather_stats(model, shape, list(ids.split(2)), progress=False)
    layers = [convert_layer(cfg, shape, read_attention(d.self_attn, shape), s)
              for d, s in zip(decoder_layers(model), stats, strict=True)]  # fmt: skip
    return shape, stats, layers


def full_rank(shape, r):
    return shape.num_kv_heads * (2 * shape.head_dim - 2 * r)


@pytest.mark.parametrize("svd", ["activation", "functional", "weight"])
@pytest.mark.parametrize("family,heads,kv", [("llama", 4, 4), ("llama", 4, 2), ("qwen2", 4, 2), ("qwen2", 2, 1)])
def test_every_pair_kept_at_full_rank_is_the_source(family, heads, kv, svd):
    model = tiny(family, heads, kv)
    ids = token_batches()
    shape = source_shape(model.config)
    rank = min(full_rank(shape, 8), shape.hidden_size + int(family == "qwen2"))
    _, _, layers = converted(model, ConvertConfig(rope_pairs=8, latent_rank=rank, damping=0.0, svd=svd), ids)
    latent = copy.deepcopy(model)
    install_latent(latent, shape, layers)
    with torch.no_grad():
        err = (latent(ids).logits - model(ids).logits).abs().max().item()
    assert err < 1e-9, err


def partial_rope_reference(src, shape, x, pairs):
    """One layer's attention output (before o_proj) with only ``pairs`` (per KV head) rotated, straight from the
    source weights (k_norm and q_norm dynamic), angles computed from theta here."""
    b, t, _ = x.shape
    d, g = shape.head_dim, shape.group
    q = (x @ src.wq.T + (0 if src.bq is None else src.bq)).view(b, t, -1, d)
    k = (x @ src.wk.T + (0 if src.bk is None else src.bk)).view(b, t, -1, d)
    v = (x @ src.wv.T + (0 if src.bv is None else src.bv)).view(b, t, -1, d)
    pos = torch.arange(t, dtype=torch.float64)
    inv = shape.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None] * inv[None, :]  # (t, d/2)

    def rot(z, kept):
        z = z.clone()
        for k_ in kept.tolist():
            a, c, s = z[..., k_].clone(), ang[:, k_].cos(), ang[:, k_].sin()
            z[..., k_], z[..., k_ + d // 2] = a * c - z[..., k_ + d // 2] * s, z[..., k_ + d // 2] * c + a * s
        return z

    q = torch.stack([rot(q[:, :, h], pairs[h // g]) for h in range(shape.num_heads)], 2)
    k = torch.stack([rot(k[:, :, j], pairs[j]) for j in range(shape.num_kv_heads)], 2)
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, t, -1)


@pytest.mark.parametrize("rope", ["uniform", "contribution"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dropped_pairs_at_full_rank_match_a_partial_rope_reference(family, rope):
    model = tiny(family, 4, 2)
    ids = token_batches()
    shape = source_shape(model.config)
    r = 2
    rank = min(full_rank(shape, r), shape.hidden_size + int(family == "qwen2"))
    _, _, layers = converted(model, ConvertConfig(rope_pairs=r, latent_rank=rank, rope=rope, damping=0.0), ids)
    latent = copy.deepcopy(model)
    install_latent(latent, shape, layers)
    x = torch.randn(2, 12, shape.hidden_size, dtype=torch.float64)
    dec = decoder_layers(model)[0]
    src = read_attention(dec.self_attn, shape)
    want = dec.self_attn.o_proj(partial_rope_reference(src, shape, x, layers[0].pairs))
    # float64 angles (transformers' rotary embedding computes them in float32)
    d = shape.head_dim
    ang = torch.arange(12, dtype=torch.float64)[:, None] * shape.rope_theta ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    ang = torch.cat([ang, ang], -1)[None].expand(2, -1, -1)
    got, _ = decoder_layers(latent)[0].self_attn(x, (ang.cos(), ang.sin()))
    assert (got - want).abs().max().item() < 1e-11


def test_the_calibrated_knorm_constant_is_exact_when_every_key_has_one_rms():
    """k_norm's 1/rms(k) is a constant when each key's RMS is: inputs on a sphere and orthonormal key rows."""
    model = tiny("qwen3", 2, 1)
    shape = source_shape(model.config)
    dec = decoder_layers(model)[0]
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(shape.hidden_size, shape.head_dim, dtype=torch.float64))
        dec.self_attn.k_proj.weight.copy_(q.T)  # on inputs x = q z the key is z
    from quantmla.convert.stats import LayerAccumulator

    acc = LayerAccumulator(read_attention(dec.self_attn, shape), shape)
    z = torch.nn.functional.normalize(torch.randn(64, shape.head_dim, dtype=torch.float64), dim=-1) * 3.0
    acc.add(z @ q.T)  # every key has norm 3
    rms = math.sqrt(9.0 / shape.head_dim + read_attention(dec.self_attn, shape).eps)
    assert acc.stats.knorm_scale().item() == pytest.approx(1 / rms, rel=1e-12)


def test_contribution_keeps_the_pairs_with_the_largest_q_times_k_norms():
    model = tiny("llama", 4, 2)
    shape = source_shape(model.config)
    stats = gather_stats(model, shape, list(token_batches().split(2)), progress=False)[0]
    cfg = ConvertConfig(rope_pairs=3, latent_rank=8, rope="contribution")
    score = stats.mean_q_pair().view(2, 2, -1).sum(1) * stats.mean_k_pair()
    got = choose_pairs(cfg, shape, stats)
    for g in range(2):
        top = set(score[g].argsort(descending=True)[:3].tolist())
        assert set(got[g].tolist()) == top
    assert torch.equal(
        choose_pairs(ConvertConfig(rope_pairs=2, latent_rank=8), shape, stats), torch.tensor([[0, 4]] * 2)
    )


def test_factorise_is_exact_at_full_rank_and_activation_aware_is_optimal_under_the_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 8, dtype=torch.float64, generator=g)
    x = torch.randn(500, 8, dtype=torch.float64, generator=g) * torch.logspace(0, -2, 8, dtype=torch.float64)
    moment = x.T @ x / len(x)
    for m in (None, moment):
        up, down = factorise(w, 8, m, 0.0)
        assert (up @ down - w).abs().max() < 1e-10
    err = lambda up, down: ((x @ (w - up @ down).T) ** 2).sum()  # noqa: E731
    act, wgt = err(*factorise(w, 3, moment, 0.0)), err(*factorise(w, 3, None, 0.0))
    assert act < wgt
    # Eckart-Young under the inputs: the error is the trailing singular values of w @ moment^(1/2)
    lam, u = torch.linalg.eigh(moment)
    s = torch.linalg.svdvals(w @ (u * lam.sqrt()) @ u.T)
    assert act / len(x) == pytest.approx(float((s[3:] ** 2).sum()), rel=1e-9)


def test_a_left_metric_weights_the_output_error_optimally():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 8, dtype=torch.float64, generator=g)
    x = torch.randn(400, 8, dtype=torch.float64, generator=g) * torch.logspace(0, -1, 8, dtype=torch.float64)
    a = torch.randn(10, 10, dtype=torch.float64, generator=g)
    left = a @ a.T / 10
    moment = x.T @ x / len(x)
    up, down = factorise(w, 10, moment, 0.0, left)
    assert (up @ down - w).abs().max() < 1e-9
    err = lambda up, down: torch.einsum("tr,rs,ts->", x @ (w - up @ down).T, left, x @ (w - up @ down).T)  # noqa: E731
    got = err(*factorise(w, 3, moment, 0.0, left))
    lam, u = torch.linalg.eigh(moment)
    ll, lu = torch.linalg.eigh(left)
    s = torch.linalg.svdvals((lu * ll.sqrt()) @ lu.T @ w @ (u * lam.sqrt()) @ u.T)
    assert got / len(x) == pytest.approx(float((s[3:] ** 2).sum()), rel=1e-9)
    assert got < err(*factorise(w, 3, moment, 0.0))  # the right-only optimum is worse under the left metric


@pytest.mark.parametrize("bad,match", [
    (dict(rope="high"), "rope='high'; valid: uniform, contribution"),
    (dict(svd="lowrank"), "svd='lowrank'"),
    (dict(latent="two"), "latent='two'"),
    (dict(knorm="none"), "knorm='none'"),
    (dict(rope_pairs=0), "rope_pairs=0"),
    (dict(latent_rank=0), "latent_rank=0"),
    (dict(latent="split", latent_rank=7), "even"),
    (dict(damping=1.5), "damping"),
])  # fmt: skip
def test_bad_settings_are_one_clear_error(bad, match):
    kw = dict(rope_pairs=2, latent_rank=8) | bad
    with pytest.raises(ValueError, match=match):
        ConvertConfig(**kw)


def test_pair_counts_and_ranks_the_heads_cannot_give_are_refused():
    with pytest.raises(ValueError, match="rope_pairs=9: a head of 16 has 8 pairs; valid: 1 .. 8"):
        ConvertConfig(rope_pairs=9, latent_rank=8).check_dims(16, 2, 64)
    with pytest.raises(ValueError, match="must divide the head's 8 pairs; valid: 1, 2, 4"):
        ConvertConfig(rope_pairs=3, latent_rank=8).check_dims(16, 2, 64)
    with pytest.raises(ValueError, match=r"latent_rank=61 .* valid: 1 \.\. 60"):
        ConvertConfig(rope_pairs=1, latent_rank=61).check_dims(16, 2, 64)
    with pytest.raises(ValueError, match=r"latent_rank=65 .* valid: 1 \.\. 64"):
        ConvertConfig(rope_pairs=1, latent_rank=65).check_dims(16, 4, 64)
