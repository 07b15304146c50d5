"""A progress bar that also says which decoder layer the forward is in: a large model's forward (offloaded
layers read from the host or disk one after another) takes long enough that the bar should move within it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (``model.model.layers``), in order; ``[]`` if it has none there."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


@contextmanager
def layer_postfix(model: nn.Module, bar) -> Iterator[None]:
    """Within the block, each decoder layer's forward sets ``bar``'s postfix to ``layer i/L`` (a tqdm bar; its
    ETA stays the bar's own)."""
    layers = decoder_layers(model)
    if bar is None or getattr(bar, "disable", False) or not layers:
        yield
        return
    handles = []
    for i, layer in enumerate(layers):

        def pre(module, args, i=i):
            bar.set_postfix_str(f"layer {i + 1}/{len(layers)}", refresh=False)

        handles.append(layer.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
