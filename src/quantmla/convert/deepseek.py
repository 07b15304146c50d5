"""Export of converted layers as a DeepSeek model that stock transformers and vLLM load: ``deepseek_v3`` for
dense sources, ``deepseek_v2`` (softmax routing) for Qwen3-MoE.

What DeepSeek's format cannot hold is approximated here, and each approximation is exact in the case named:
- one RoPE key shared by every head (the source has one per KV head): per kept pair, the KV heads' keys are
  replaced by their first principal component, weighted by how much the group's query heads read the pair; each
  query head's RoPE rows take its group's coefficient (exact with one KV head);
- the kept pairs must follow DeepSeek's schedule ``theta^(-2j/d_rope)``: uniform pairs from 0 do (the same theta),
  per-head (contribution) pairs do not and are refused;
- Qwen3's per-head q_norm (and a query bias) go through DeepSeek's query path ``q_b(RMSNorm(q_a x))``: one RMS
  over all heads, times a fitted constant per head (exact when the heads' RMS ratios are constant);
- DeepSeek's latent RMSNorm (``kv_a_layernorm``, always applied) is made linear by default: the latent's rows of
  ``kv_a_proj_with_mqa`` are scaled so that its mean RMS is ``LINEAR_MARGIN * sqrt(eps)``, where the norm divides by
  ``sqrt(mean(c^2) + eps) ~ sqrt(eps)``, and the norm's gain scales it back (relative error
  ``~ (LINEAR_MARGIN * rms(c) / mean rms)^2 / 2`` a token: 5e-7 at the mean RMS); a query bias without q_norm goes
  through ``q_a_layernorm`` the same way. ``latent_norm='rms'`` keeps a plain RMSNorm with the latent's mean RMS as
  gain instead (exact when each token's latent has that RMS).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from quantmla.convert.source import SourceShape
from quantmla.convert.stats import LayerStats
from quantmla.convert.surgery import LatentLayer, rope_dims

#: what the export writes for each source kind
TARGETS = {False: "deepseek_v3", True: "deepseek_v2"}
#: a linear norm's pre-norm input: its mean RMS as a share of sqrt(eps) (small enough that eps dominates, large enough
#: for float32 and bfloat16, whose exponents reach far lower; float16 would not)
LINEAR_MARGIN = 1e-3


def check_exportable(layers: list[LatentLayer], shape: SourceShape) -> None:
    """One ``ValueError`` if the converted layers cannot be written in DeepSeek's format."""
    half = shape.head_dim // 2
    for i, layer in enumerate(layers):
        r = layer.rope_pairs
        want = torch.arange(0, half, half // r)[:r]
        if half % r or not all(torch.equal(p, want) for p in layer.pairs):
            raise ValueError(
                f"layer {i}: kept pairs {layer.pairs.tolist()} are not every {half // max(r, 1)}-th pair from 0, the "
                "only choice DeepSeek's one RoPE key (theta^(-2j/d_rope)) expresses; valid: rope='uniform'"
            )
        if r >= half:
            raise ValueError(f"layer {i}: every pair kept leaves no NoPE dimension (qk_nope_head_dim=0)")


def interleave(rows: torch.Tensor) -> torch.Tensor:
    """Rotate-half order (first halves, then second halves of ``r`` pairs) -> DeepSeek's ``(2j, 2j+1)`` order."""
    r = rows.shape[0] // 2
    return torch.stack([rows[:r], rows[r:]], 1).reshape(rows.shape)


def shared_rope_key(layer: LatentLayer, shape: SourceShape, stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, coef)``: the shared RoPE key's rows ``(2r, n)`` (rotate-half order) and each KV head's coefficient
    per pair ``(kv, r)`` with ``k_g ~ coef[g] * shared`` (weighted principal component per pair)."""
    kv, r, pairs = shape.num_kv_heads, layer.rope_pairs, shape.head_dim // 2
    moment = stats.second_moment
    q_energy = stats.mean_q_pair_sq().view(kv, shape.group, pairs).sum(1)  # (kv, pairs)
    rows = torch.zeros(2 * r, layer.wkr.shape[-1], dtype=torch.float64)
    coef = torch.zeros(kv, r, dtype=torch.float64)
    for j in range(r):
        w = layer.wkr[:, [j, r + j]]  # (kv, 2, n)
        cov = torch.einsum("gcn,nm,hcm->gh", w, moment, w)
        omega = q_energy[torch.arange(kv), layer.pairs[:, j]].clamp_min(1e-30).sqrt()
        lam, vec = torch.linalg.eigh(omega[:, None] * cov * omega[None, :])
        u = vec[:, -1]
        u = u * torch.sign(u.sum()) if u.sum() != 0 else u
        a, coef[:, j] = u * omega, u / omega
        shared = torch.einsum("g,gcn->cn", a, w)
        rows[j], rows[r + j] = shared[0], shared[1]
    return rows, coef


def latent_rms(layer: LatentLayer, stats: LayerStats) -> float:
    """``sqrt(E||c||^2 / latent)``: the latent's mean RMS over the calibration tokens."""
    return float(torch.einsum("cn,nm,cm->", layer.down, stats.second_moment, layer.down).div(layer.latent_rank).sqrt())


def deepseek_config(source_config, shape: SourceShape, layers: list[LatentLayer], q_lora: bool, bias: bool):
    first = layers[0]
    r = first.rope_pairs
    common = dict(
        vocab_size=source_config.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=getattr(source_config, "intermediate_size", None) or 1,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        q_lora_rank=shape.num_heads * shape.head_dim if q_lora else None,
        kv_lora_rank=first.latent_rank,
        qk_rope_head_dim=2 * r,
        qk_nope_head_dim=shape.head_dim - 2 * r,
        v_head_dim=shape.head_dim,
        max_position_embeddings=source_config.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        attention_bias=bias,
        tie_word_embeddings=bool(getattr(source_config, "tie_word_embeddings", False)),
        bos_token_id=source_config.bos_token_id,
        eos_token_id=source_config.eos_token_id,
        pad_token_id=getattr(source_config, "pad_token_id", None),
        hidden_act="silu",
    )
    if shape.moe:
        return DeepseekV2Config(
            **common,
            moe_intermediate_size=source_config.moe_intermediate_size,
            n_routed_experts=source_config.num_experts,
            num_experts_per_tok=source_config.num_experts_per_tok,
            n_shared_experts=1,
            first_k_dense_replace=0,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
        )
    return DeepseekV3Config(
        **common,
        moe_intermediate_size=1,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=shape.num_layers,
        rope_interleave=True,
    )


def linear_scale(rms: float, eps: float) -> float:
    """The factor on a norm's input that puts its mean RMS ``rms`` at ``LINEAR_MARGIN * sqrt(eps)``."""
    return LINEAR_MARGIN * eps**0.5 / rms


def attention_state(layer: LatentLayer, shape: SourceShape, stats: LayerStats, q_lora: bool,
                    latent_norm: str = "linear") -> dict[str, torch.Tensor]:  # fmt: skip
    """One layer's DeepSeek attention tensors (float64; ``o_proj`` excluded)."""
    eps = shape.rms_norm_eps
    d, g = shape.head_dim, shape.group
    hidden = shape.hidden_size
    k_rows, coef = shared_rope_key(layer, shape, stats)
    out: dict[str, torch.Tensor] = {}
    # the query map of head h: [its NoPE dims; its RoPE dims times the group's coefficients, interleaved]
    blocks = []
    for h in range(shape.num_heads):
        grp = h // g
        rope, nope = rope_dims(layer.pairs[grp], d)
        eye = torch.eye(d, dtype=torch.float64)
        rope_rows = eye[rope] * torch.cat([coef[grp], coef[grp]])[:, None]
        blocks.append(torch.cat([eye[nope], interleave(rope_rows)]))
    if q_lora:
        # q_norm: one RMS over all heads times a constant per head; a bias alone: the norm made linear
        s = 1.0 if layer.q_gain is not None else linear_scale(float(stats.mean_q_rms()), eps)
        out["q_a_proj.weight"] = layer.wq * s
        if layer.bq is not None:
            out["q_a_proj.bias"] = layer.bq * s
        out["q_a_layernorm.weight"] = torch.full((shape.num_heads * d,), 1.0 if s == 1.0 else eps**0.5 / s,
                                                 dtype=torch.float64)  # fmt: skip
        if layer.q_gain is not None:
            scale = stats.qnorm_scale()[:, None] * layer.q_gain[None, :]  # (heads, d)
        else:
            scale = torch.ones(shape.num_heads, d, dtype=torch.float64)
        out["q_b_proj.weight"] = torch.block_diag(*[b * s[None, :] for b, s in zip(blocks, scale, strict=True)])
    else:
        out["q_proj.weight"] = torch.cat(
            [b @ layer.wq.view(shape.num_heads, d, hidden)[h] for h, b in enumerate(blocks)]
        )
    rms = latent_rms(layer, stats)
    s = linear_scale(rms, eps) if latent_norm == "linear" else 1.0
    kv_a = torch.cat([layer.down * s, interleave(k_rows)])
    if layer.biased:
        out["kv_a_proj_with_mqa.weight"], out["kv_a_proj_with_mqa.bias"] = kv_a[:, :hidden], kv_a[:, hidden]
    else:
        out["kv_a_proj_with_mqa.weight"] = kv_a
    gain = eps**0.5 / s if latent_norm == "linear" else rms
    out["kv_a_layernorm.weight"] = torch.full((layer.latent_rank,), gain, dtype=torch.float64)
    out["kv_b_proj.weight"] = torch.cat(
        [torch.cat([layer.up_k[h // g], layer.up_v[h // g]]) for h in range(shape.num_heads)]
    )
    return out


def build_deepseek(source: nn.Module, shape: SourceShape, layers: list[LatentLayer], stats: list[LayerStats],
                   dtype: torch.dtype | None = None, latent_norm: str = "linear") -> nn.Module:  # fmt: skip
    """The DeepSeek model of the converted ``layers`` (source's embeddings, norms, MLPs/experts and head)."""
    check_exportable(layers, shape)
    q_lora = any(layer.q_gain is not None or layer.bq is not None for layer in layers)
    bias = any(layer.bq is not None or layer.biased for layer in layers)
    config = deepseek_config(source.config, shape, layers, q_lora, bias)
    dtype = dtype or next(source.parameters()).dtype
    cls = DeepseekV2ForCausalLM if shape.moe else DeepseekV3ForCausalLM
    # the source's experts implementation (eager in float64: the grouped kernels take float32 and narrower)
    experts = getattr(source.config, "_experts_implementation", None)
    model = (cls._from_config(config, experts_implementation=experts) if experts else cls(config)).to(dtype)
    src_state = source.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, t in src_state.items():
        if ".self_attn." in name:
            continue
        state[name] = t
    for i, (layer, st) in enumerate(zip(layers, stats, strict=True)):
        pre = f"model.layers.{i}.self_attn."
        for k, v in attention_state(layer, shape, st, q_lora, latent_norm).items():
            state[pre + k] = v
        state[pre + "o_proj.weight"] = src_state[pre + "o_proj.weight"]
        if bias:
            o_bias = src_state.get(pre + "o_proj.bias")
            state[pre + "o_proj.bias"] = o_bias if o_bias is not None else torch.zeros(shape.hidden_size)
            if q_lora and pre + "q_a_proj.bias" not in state:
                state[pre + "q_a_proj.bias"] = torch.zeros(shape.num_heads * shape.head_dim)
            if pre + "kv_a_proj_with_mqa.bias" not in state:
                state[pre + "kv_a_proj_with_mqa.bias"] = torch.zeros(layer.latent_rank + 2 * layer.rope_pairs)
        if shape.moe:  # the one shared expert DeepSeek-V2 always has, zeroed: it adds nothing
            for p in ("gate_proj", "up_proj", "down_proj"):
                state[f"model.layers.{i}.mlp.shared_experts.{p}.weight"] = torch.zeros_like(
                    model.model.layers[i].mlp.shared_experts.get_parameter(f"{p}.weight")
                )
    target = model.state_dict()
    missing = [k for k in target if k not in state and not k.endswith("e_score_correction_bias")]
    if model.config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in state if k not in target]
    if missing or unexpected:
        raise RuntimeError(f"export mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]} (a bug)")
    with torch.no_grad():
        for k, v in state.items():
            if target[k].shape != v.shape:
                raise RuntimeError(f"{k}: shape {tuple(v.shape)} for {tuple(target[k].shape)} (a bug)")
            target[k].copy_(v.to(target[k].dtype))
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


class LinearNorm(nn.Module):
    """A norm made linear, as distillation trains it: ``x * weight``. Adam moves every weight by about its learning
    rate, so the latent rows scaled into the RMSNorm's epsilon (~1e-6) would be overwritten; they train unscaled
    here and :func:`fold_linear_norms` scales them back."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.to(x.dtype)


def _linear_norms(model: nn.Module, layers: list[LatentLayer], latent_norm: str):
    """``(layer index, attention, norm name, projection name, rows)`` of each norm the export made linear."""
    for i, (dec, layer) in enumerate(zip(model.model.layers, layers, strict=True)):
        attn = dec.self_attn
        if latent_norm == "linear":
            yield i, attn, "kv_a_layernorm", "kv_a_proj_with_mqa", layer.latent_rank
        if layer.q_gain is None and getattr(attn, "q_a_layernorm", None) is not None:
            yield i, attn, "q_a_layernorm", "q_a_proj", attn.q_a_proj.out_features


@torch.no_grad()
def unfold_linear_norms(model: nn.Module, layers: list[LatentLayer], latent_norm: str, eps: float) -> None:
    """Replace each linear-made RMSNorm by a :class:`LinearNorm` (the same function, the rows unscaled)."""
    for _, attn, norm, proj, rows in _linear_norms(model, layers, latent_norm):
        module = getattr(attn, norm)
        scale = eps**0.5 / module.weight.detach().double().mean().item()
        p = getattr(attn, proj)
        p.weight[:rows] /= scale
        if p.bias is not None:
            p.bias[:rows] /= scale
        setattr(attn, norm, LinearNorm(module.weight * scale / eps**0.5))


@torch.no_grad()
def fold_linear_norms(model: nn.Module, layers: list[LatentLayer], stats: list[LayerStats], latent_norm: str,
                      eps: float) -> None:  # fmt: skip
    """Undo :func:`unfold_linear_norms`: each :class:`LinearNorm` back to an RMSNorm within its epsilon, its rows
    scaled by the RMS they give under the calibration inputs' second moment."""
    for i, attn, norm, proj, rows in list(_linear_norms(model, layers, latent_norm)):
        module = getattr(attn, norm)
        if not isinstance(module, LinearNorm):
            raise RuntimeError(f"layer {i}: {norm} is not a LinearNorm: unfold_linear_norms did not run (a bug)")
        p = getattr(attn, proj)
        moment = stats[i].second_moment
        w = p.weight[:rows].double().cpu()
        if p.bias is not None and len(moment) == w.shape[1] + 1:
            w = torch.cat([w, p.bias[:rows].double().cpu()[:, None]], 1)
        moment = moment[: w.shape[1], : w.shape[1]]
        scale = linear_scale(float(torch.einsum("cn,nm,cm->", w, moment, w).div(rows).sqrt()), eps)
        p.weight[:rows] *= scale
        if p.bias is not None:
            p.bias[:rows] *= scale
        rms_class = type(model.model.layers[i].input_layernorm)  # the model's own RMSNorm
        rms_norm = rms_class(rows, eps=eps).to(module.weight.device, module.weight.dtype)
        rms_norm.weight.copy_(module.weight * eps**0.5 / scale)
        setattr(attn, norm, rms_norm)
