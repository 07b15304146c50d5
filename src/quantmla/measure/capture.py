"""Capture the inputs of one MLA attention module, one layer at a time.

The model runs forward until the chosen attention module is called; a hook records that call's
arguments and stops the forward there, so only one layer's tensors are ever held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantmla.models.adapter import get_adapter


class _Stop(Exception):
    pass


@dataclass
class AttentionCall:
    """Arguments of one call of an attention module (kwargs as the decoder layer passed them)."""

    module: nn.Module
    args: tuple
    kwargs: dict

    def to(self, device) -> AttentionCall:
        def mv(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, tuple):
                return tuple(mv(y) for y in x)
            return x

        return AttentionCall(self.module, mv(self.args), {k: mv(v) for k, v in self.kwargs.items()})


def capture_call(module: nn.Module, forward) -> AttentionCall:
    """The arguments of ``module``'s first call while ``forward()`` runs; the forward stops there."""
    seen: dict = {}

    def hook(mod, args, kwargs):
        seen["call"] = AttentionCall(mod, tuple(args), dict(kwargs))
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            forward()
    except _Stop:
        pass
    finally:
        handle.remove()
    if "call" not in seen:
        raise RuntimeError(f"{type(module).__name__} was not called by the forward")
    return seen["call"]


@torch.no_grad()
def capture_attention_call(model: nn.Module, cache_index: int, input_ids: torch.Tensor) -> AttentionCall:
    """Run ``model`` on ``input_ids`` up to attention module ``cache_index`` and return its inputs."""
    modules = dict(get_adapter(model).attention_modules(model))
    if cache_index not in modules:
        raise ValueError(f"no attention module with cache index {cache_index}; valid: {sorted(modules)}")
    return capture_call(modules[cache_index], lambda: model(input_ids, use_cache=False))
