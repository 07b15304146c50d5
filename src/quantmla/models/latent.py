"""Absorbed (latent) MLA attention through transformers' own extension points.

transformers' MLA modules (>= 5.15) cache the latent ``(c_t, k^R_t)`` and re-expand it through
``kv_b_proj`` on every step (``expand_kv``). ``enable_latent_attention`` replaces that per module
with a pass-through and registers an attention function that computes, per METHOD.md section 1,

    s_{h,t} = scale * ((q_h^nope @ W_UK,h) . c_t + q_h^pe . k^R_t),
    o_h = (sum_t softmax(s_h)_t c_t) @ W_UV,h.T,

so the cache is read as the 576-wide latent only (a call with many queries, e.g. a prefill, computes the same
attention in the expanded form, :mod:`quantmla.models.expanded`, where that is fewer operations). Module globals
are never touched.

The pass-through ``expand_kv`` follows the active attention implementation: when the model is switched
to another one (``model.set_attn_implementation("sdpa")``, or a write to ``config._attn_implementation``),
each module expands the latent through ``kv_b_proj`` again, exactly as transformers does, and switching
back to ``quantmla_latent`` resumes the absorbed path. A forward pre-hook hands the attention function
the cache the module was called with, so a cache backend with its own decode kernel is reached
explicitly (``cache.decode_backend(layer_idx)``), never through attributes set on tensors.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd import forward_ad
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from quantmla.models import families  # noqa: F401  (registers the adapters)
from quantmla.models.adapter import MLAAdapter, get_adapter
from quantmla.models.expanded import expanded_is_cheaper, expanded_latent_attention

ATTN_IMPLEMENTATION = "quantmla_latent"
_STATE_ATTR = "_quantmla_latent"


def _latent_mask(*args, **kwargs):
    """Always materialise a boolean mask (True = attend): the latent path never skips it."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _latent_expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
    """Replacement for ``expand_kv``: under ``quantmla_latent`` hand the latent and the RoPE key on
    unexpanded; under any other implementation expand them as transformers does."""
    if self.config._attn_implementation == ATTN_IMPLEMENTATION:
        return kv_nope, k_rot
    state = module_state(self)
    if state is not None and _decode_backend(state.cache, self.layer_idx) is not None:
        raise RuntimeError(
            f"attn_implementation is {self.config._attn_implementation!r}, but this step's cache layer "
            f"{self.layer_idx} decodes through quantmla's kernel, which only {ATTN_IMPLEMENTATION!r} can read; "
            f"switch back with model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) or build the cache with "
            "backend='torch'"
        )
    return type(self).expand_kv(self, kv_nope, k_rot)


def _decode_backend(cache, layer_idx: int):
    """The object that attends this single-token step of ``cache`` layer ``layer_idx`` itself, if any."""
    fn = getattr(cache, "decode_backend", None)
    return None if fn is None else fn(layer_idx)


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    return_probs: bool = False,
    dropout: float = 0.0,
):
    """Reference absorbed MLA attention.

    Shapes: ``q_nope [B,H,S,d_n]``, ``q_pe [B,H,S,d_r]``, ``latent [B,1,L,d_c]``,
    ``rope_key [B,1,L,d_r]``, ``w_uk [H,d_n,d_c]``, ``w_uv [H,d_v,d_c]``; ``mask`` boolean
    ``[B or 1,1,S,L]`` (True = attend), additive float, or None (causal, aligned to the end).
    ``dropout > 0`` drops attention probabilities as transformers' eager attention does in training (after the
    softmax, before the values; the probabilities returned are the dropped ones, as eager returns them).
    Returns ``[B,S,H,d_v]``, and with ``return_probs`` also the attention probabilities ``[B,H,S,L]``.
    """
    q_lat = torch.einsum("bhsd,hdc->bhsc", q_nope, w_uk.to(q_nope.dtype))
    scores = q_lat @ latent.transpose(-1, -2) + q_pe @ rope_key.transpose(-1, -2)
    acc = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(acc) * scale
    s, l_kv = scores.shape[-2], scores.shape[-1]
    if mask is None and s > 1:
        pos_q = torch.arange(s, device=scores.device).unsqueeze(1) + (l_kv - s)
        mask = torch.arange(l_kv, device=scores.device).unsqueeze(0) <= pos_q
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(acc).min)
        else:
            scores = scores + mask.to(acc)
    probs = torch.softmax(scores, dim=-1).to(latent.dtype)
    if dropout > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    o_lat = probs @ latent  # [B,H,S,d_c]
    out = torch.einsum("bhsc,hvc->bhsv", o_lat, w_uv.to(o_lat.dtype)).transpose(1, 2).contiguous()
    return (out, probs) if return_probs else out


def latent_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """Attention function registered as ``quantmla_latent``.

    With the pass-through ``expand_kv``, ``key`` is the content latent ``[B,1,L,d_c]`` and
    ``value`` the RoPE key ``[B,1,L,d_r]`` exactly as the cache returned them.
    """
    state = module_state(module)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={ATTN_IMPLEMENTATION!r} but latent "
            "attention was not enabled on it; call quantmla.enable_latent_attention(model)"
        )
    dropout = dropout if module.training else 0.0  # (the families pass their rate only in training already)
    with onloaded(state.adapter.kv_b_proj(module)):  # its weights are read here, its forward never runs
        return _latent_attention(module, state, query, key, value, attention_mask, scaling, dropout, **kwargs)


@contextmanager
def onloaded(module: nn.Module) -> Iterator[None]:
    """Within the block, the weights of ``module`` are on its execution device even if accelerate offloads them
    (its hook loads them when the module's forward runs; latent attention reads them without that forward)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        yield
        return
    hook.pre_forward(module)
    try:
        yield
    finally:
        hook.post_forward(module, None)


def _latent_attention(module, state, query, key, value, attention_mask, scaling, dropout, **kwargs):
    adapter = state.adapter
    nope = module.qk_nope_head_dim
    q_nope, q_pe = query[..., :nope], query[..., nope:]
    scale = module.scaling if scaling is None else scaling
    want_probs = bool(kwargs.get("output_attentions", False))
    w_uk, w_uv = adapter.w_uk(module), adapter.w_uv(module)
    backend = _decode_backend(state.cache, module.layer_idx)  # a decode step the cache attends itself
    if dropout and (backend is not None or state.simulation is not None):
        raise NotImplementedError(
            f"attention dropout ({dropout}, training mode) through a quantised decode path: call model.eval() "
            "to decode, or train without the fused cache backend and the decode-cache simulation"
        )
    if backend is not None:
        if want_probs:
            raise NotImplementedError(
                "output_attentions=True: the fused decode kernel does not form the attention probabilities; "
                "build the cache with backend='torch' to get them"
            )
        return backend.attend(q_nope, q_pe, w_uk, w_uv, scale, attention_mask), None
    if state.simulation is not None:
        if want_probs:
            raise NotImplementedError("output_attentions=True is not available under the decode-cache simulation")
        return state.simulation.attend(q_nope, q_pe, key, value, w_uk, w_uv, scale, attention_mask), None
    if want_probs or dropout:  # the absorbed form forms the probabilities: it returns them, or drops them as eager does
        out = absorbed_attention(
            q_nope, q_pe, key, value, w_uk, w_uv, scale, attention_mask, return_probs=want_probs, dropout=dropout
        )
        return out if want_probs else (out, None)
    s, l_kv = q_nope.shape[-2], key.shape[-2]
    cheaper = expanded_is_cheaper(s, l_kv, key.shape[-1], nope, q_pe.shape[-1], w_uv.shape[1])  # many queries
    if cheaper and not _has_tangent(query, key, value):  # (the fused kernels have no forward-mode derivative)
        return expanded_latent_attention(q_nope, q_pe, key, value, w_uk, w_uv, scale, attention_mask), None
    return absorbed_attention(q_nope, q_pe, key, value, w_uk, w_uv, scale, attention_mask), None


def _has_tangent(*tensors: torch.Tensor) -> bool:
    """Whether a forward-mode derivative is being carried through any of ``tensors``."""
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


@dataclass
class LatentModuleState:
    """What latent attention keeps on each MLA module."""

    adapter: MLAAdapter
    #: when set, an object whose ``attend`` replaces :func:`absorbed_attention` (e.g. the decode-cache
    #: simulation of ``quantmla eval ppl``)
    simulation: object | None = None
    #: the cache of the module's call in progress (set by a forward pre-hook, cleared after the call)
    cache: object | None = None


def _bind_cache(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: remember the cache this call of ``module`` was given."""
    state = module_state(module)
    state.cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if state.cache is None and len(args) > 3:  # (hidden_states, position_embeddings, attention_mask, cache)
        state.cache = args[3]
    declare = getattr(state.cache, "declare_latent_reader", None)
    if declare is not None and module.config._attn_implementation == ATTN_IMPLEMENTATION:
        declare()  # this cache may now decode through its kernel: this module can read such a step


def _release_cache(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    module_state(module).cache = None


def module_state(module: nn.Module) -> LatentModuleState | None:
    """The latent-attention state of one MLA module, ``None`` if latent attention is not enabled on it."""
    return getattr(module, _STATE_ATTR, None)


def module_states(model: nn.Module) -> list[LatentModuleState]:
    states = [getattr(m, _STATE_ATTR) for m in model.modules() if hasattr(m, _STATE_ATTR)]
    if not states:
        raise ValueError("latent attention is not enabled on this model; call quantmla.enable_latent_attention")
    return states


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, latent_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _latent_mask)


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def enable_latent_attention(model: nn.Module) -> nn.Module:
    """Switch every MLA module of ``model`` to absorbed attention over the cached latent (in place)."""
    adapter = get_adapter(model)
    _register()
    modules = list(adapter.attention_modules(model))
    if not modules:
        raise ValueError(f"no {adapter.attention_classes} modules found in {type(model).__name__}")
    if not hasattr(model, "_quantmla_prev_attn"):
        model._quantmla_prev_attn = model.config._attn_implementation
    for _, attn in modules:
        if module_state(attn) is not None:  # enabled before: keep its hooks
            continue
        attn.expand_kv = types.MethodType(_latent_expand_kv, attn)
        attn.register_forward_pre_hook(_bind_cache, with_kwargs=True)
        attn.register_forward_hook(_release_cache, with_kwargs=True, always_call=True)
        setattr(attn, _STATE_ATTR, LatentModuleState(adapter))
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    return model


def disable_latent_attention(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_latent_attention`."""
    adapter = get_adapter(model)
    for _, attn in adapter.attention_modules(model):
        attn.__dict__.pop("expand_kv", None)
        attn.__dict__.pop(_STATE_ATTR, None)
        for hooks, fn in ((attn._forward_pre_hooks, _bind_cache), (attn._forward_hooks, _release_cache)):
            for key in [k for k, h in hooks.items() if h is fn]:  # by identity: survives deepcopy
                del hooks[key]
    prev = model.__dict__.pop("_quantmla_prev_attn", None)
    if prev is not None:
        _set_attn_implementation(model, prev)
    return model


def is_latent_attention_enabled(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
