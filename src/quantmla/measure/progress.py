"""A progress bar that also says which decoder layer the forward is in: a large model's forward (offloaded
layers read from the host or disk one after another) takes long enough that the bar should move within it."""

from __future__ import annotations

import time
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
    ETA stays the bar's own) and redraws the bar at tqdm's own rate (``bar.mininterval``, as ``update`` does): a
    slow forward shows every layer as it starts, a fast one does not redraw its bar L times a batch."""
    layers = decoder_layers(model)
    if bar is None or getattr(bar, "disable", False) or not layers:
        yield
        return
    handles = []
    drawn = [0.0]  # when a layer last redrew the bar; bar.last_print_t stays update()'s (its rate and ETA use it)
    for i, layer in enumerate(layers):

        def pre(module, args, i=i):
            bar.set_postfix_str(f"layer {i + 1}/{len(layers)}", refresh=False)
            now = time.time()  # tqdm's clock (bar.last_print_t)
            if now - max(bar.last_print_t, drawn[0]) >= bar.mininterval:
                bar.refresh()
                drawn[0] = now

        handles.append(layer.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
