"""Where a layer's attention inputs come from.

* :class:`ModelInputs`: the whole model in memory, run from the embedding up to the layer for each batch (the
  layer's inputs are recomputed for every layer: ``L (L + 1) / 2`` layer forwards for ``L`` layers).
* :class:`StreamedInputs`: one decoder layer at a time (:class:`~quantmla.models.streaming.CheckpointLayers`).
  The hidden states at the current layer's input are kept for every registered set of token windows, on the host
  or on disk; :meth:`StreamedInputs.advance` runs the current layer once on them to get the next layer's inputs:
  ``L`` layer forwards in all.

Both give the same :class:`~quantmla.measure.capture.AttentionCall` objects, so every per-layer method runs on
either.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from quantmla.measure.capture import AttentionCall, capture_attention_call, capture_call
from quantmla.models.adapter import get_adapter


class LayerInputs(Protocol):
    """A source of one attention module's captured calls for a set of token windows."""

    def attention_calls(self, index: int, windows: torch.Tensor, batch_size: int) -> list[AttentionCall]: ...


#: where :class:`StreamedInputs` keeps the hidden states between layers
OFFLOAD = ("cpu", "disk")


def windows_key(windows: torch.Tensor) -> str:
    """A key of a set of token windows: its shape and a digest of its tokens."""
    digest = hashlib.sha256(windows.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
    return f"{tuple(windows.shape)}-{digest}"


@dataclass
class ModelInputs:
    """Attention inputs of a whole model in memory."""

    model: nn.Module

    def attention_calls(self, index: int, windows: torch.Tensor, batch_size: int) -> list[AttentionCall]:
        device = next(self.model.parameters()).device
        return [capture_attention_call(self.model, index, windows[i : i + batch_size].to(device))
                for i in range(0, len(windows), batch_size)]  # fmt: skip


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_move(y, device) for y in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


@dataclass
class StreamedInputs:
    """Attention inputs of one decoder layer at a time, from hidden states kept between layers.

    ``windows``: every set of token windows ``[N, T]`` the methods will ask for, split into batches of
    ``batch_size``; ``offload``: ``cpu`` keeps the hidden states in host memory, ``disk`` in files under
    ``scratch`` (a temporary directory by default), read back one batch at a time.
    """

    embedding: nn.Module | None
    windows: list[torch.Tensor]
    batch_size: int
    offload: str = "cpu"
    scratch: Path | None = None
    index: int = field(default=0, init=False)
    layer_model: nn.Module | None = field(default=None, init=False, repr=False)
    _states: dict[str, list] = field(default_factory=dict, init=False, repr=False)
    _kwargs: dict[str, list] = field(default_factory=dict, init=False, repr=False)
    _own_scratch: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload={self.offload!r}; valid: {', '.join(OFFLOAD)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.offload == "disk" and self.scratch is None:
            self.scratch, self._own_scratch = Path(tempfile.mkdtemp(prefix="quantmla-activations-")), True
        if self.embedding is None:
            raise ValueError("StreamedInputs needs the embedding model (or StreamedInputs.from_snapshot)")
        device = next(self.embedding.parameters()).device
        layer = self.embedding.model.layers[0]
        for w in self.windows:
            key = windows_key(w)
            if key in self._states:
                continue
            states, kwargs = [], []
            for b, i in enumerate(range(0, len(w), self.batch_size)):
                ids = w[i : i + self.batch_size].to(device)
                call = capture_call(layer, lambda ids=ids: self.embedding(ids, use_cache=False))
                hidden = call.args[0] if call.args else call.kwargs.pop("hidden_states")
                states.append(self._store(key, b, hidden))
                kw = {k: v for k, v in call.kwargs.items() if k not in ("past_key_values", "cache", "use_cache")}
                kwargs.append(_move(kw, "cpu"))
            self._states[key], self._kwargs[key] = states, kwargs
        self.embedding = None  # its work is done: the embedding and output layers need not stay on the device

    def _store(self, key: str, b: int, hidden: torch.Tensor):
        if self.offload == "cpu":
            return hidden.detach().to("cpu")
        path = self.scratch / f"{key}-{b}-layer{self.index}.pt"  # a new file a layer: the old one may be mapped
        torch.save(hidden.detach().cpu(), path)
        return path

    def _load(self, stored, device) -> torch.Tensor:
        t = stored if isinstance(stored, torch.Tensor) else torch.load(stored, mmap=True, weights_only=True)
        return t.to(device)

    def snapshot(self, path: Path) -> None:
        """Write the kept hidden states (the current layer's inputs) and the layer keyword arguments to the new
        directory ``path``, one file a batch, for :meth:`from_snapshot` in another process."""
        path = Path(path)
        path.mkdir(parents=True)
        names = {}
        for key, states in self._states.items():
            names[key] = []
            for b, stored in enumerate(states):
                name = f"{key}-{b}.pt"
                if isinstance(stored, Path):  # already a file (offload="disk"): linked, not read and written again
                    try:
                        os.link(stored, path / name)
                    except OSError:  # another file system
                        shutil.copyfile(stored, path / name)
                else:
                    torch.save(stored, path / name)
                names[key].append(name)
        torch.save({"index": self.index, "batch_size": self.batch_size, "windows": self.windows, "states": names,
                    "kwargs": self._kwargs}, path / "inputs.pt")  # fmt: skip

    @classmethod
    def from_snapshot(cls, path: Path) -> StreamedInputs:
        """The stream as :meth:`snapshot` left it at ``path``: at the same layer, its hidden states read from there
        one batch at a time (the directory stays the caller's)."""
        path = Path(path)
        meta = torch.load(path / "inputs.pt", weights_only=False)  # our own file: tensors, lists and dicts
        self = cls.__new__(cls)
        self.embedding, self.windows, self.batch_size = None, meta["windows"], meta["batch_size"]
        self.offload, self.scratch, self.index, self.layer_model = "disk", path, meta["index"], None
        self._states = {key: [path / n for n in names] for key, names in meta["states"].items()}
        self._kwargs, self._own_scratch = meta["kwargs"], False
        return self

    def set_layer(self, index: int, layer_model: nn.Module) -> None:
        """Decoder layer ``index`` (a one-layer model, :meth:`~quantmla.models.streaming.CheckpointLayers.layer`)
        is the current one; the hidden states kept are its inputs."""
        if index != self.index:
            raise ValueError(f"the kept hidden states are layer {self.index}'s inputs, not layer {index}'s")
        self.layer_model = layer_model

    def _batches(self, windows: torch.Tensor, batch_size: int):
        key = windows_key(windows)
        if key not in self._states:
            raise ValueError(f"token windows {tuple(windows.shape)} were not registered with the stream")
        if batch_size != self.batch_size:
            raise ValueError(f"batch_size={batch_size}: the stream keeps batches of {self.batch_size}")
        return key

    def attention_calls(self, index: int, windows: torch.Tensor, batch_size: int) -> list[AttentionCall]:
        if self.layer_model is None or index != self.index:
            raise ValueError(f"attention inputs of layer {index} asked for; the stream is at layer {self.index}")
        key = self._batches(windows, batch_size)
        layer = self.layer_model.model.layers[0]
        modules = dict(get_adapter(self.layer_model).attention_modules(self.layer_model))
        device = next(layer.parameters()).device
        calls = []
        for stored, kw in zip(self._states[key], self._kwargs[key], strict=True):
            hidden, kwd = self._load(stored, device), _move(kw, device)
            calls.append(capture_call(modules[index], lambda h=hidden, k=kwd: layer(h, **k)))
        return calls

    @torch.no_grad()
    def advance(self) -> None:
        """Run the current layer on every kept batch: the kept hidden states become the next layer's inputs."""
        if self.layer_model is None:
            raise ValueError(f"layer {self.index} was not set (set_layer) before advance")
        layer = self.layer_model.model.layers[0]
        device = next(layer.parameters()).device
        for key, states in self._states.items():
            for b, (stored, kw) in enumerate(zip(states, self._kwargs[key], strict=True)):
                out = layer(self._load(stored, device), **_move(kw, device))
                out = out[0] if isinstance(out, tuple) else out
                self.index += 1  # the stored states are the next layer's inputs
                new = self._store(key, b, out)
                self.index -= 1
                if isinstance(stored, Path):
                    stored.unlink(missing_ok=True)
                states[b] = new
        self.index += 1
        self.layer_model = None

    def close(self) -> None:
        """Drop the kept hidden states (and a scratch directory this object made)."""
        self._states.clear()
        self._kwargs.clear()
        if self._own_scratch and self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
