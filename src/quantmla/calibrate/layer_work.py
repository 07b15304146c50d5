"""One decoder layer's calibration in a layer-by-layer run, and the work directory its results go to.

:func:`calibrate_layer` calibrates the attention of a one-layer model (:class:`~quantmla.models.streaming.
CheckpointLayers`) on its inputs (:class:`~quantmla.measure.layer_inputs.StreamedInputs`), :func:`finish_layer`
fuses its transforms and saves its changed tensors and result in the :class:`WorkDir`. A layer's result depends only
on its inputs, the data, the config and its own random stream, so the layers may be calibrated in any order, in
any process (:mod:`quantmla.calibrate.parallel_layers`), with the same result.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from quantmla.calibrate.api import layer_stage_on, layer_stage_windows
from quantmla.calibrate.checkpoint import Fusions, calibrated_tensor_names, changed_among, fp8_fused_in_float32
from quantmla.calibrate.related import CODEC_METHODS, fit_codec, raq_alloc_fits
from quantmla.models.adapter import get_adapter
from quantmla.transforms.fuse import fuse_transforms

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"


class WorkDir:
    """The per-layer results of one calibration run: ``state.json`` (what run), ``layer-NNN.safetensors`` (its
    changed tensors) and ``layer-NNN.pt`` (its report row and transforms; written last: the layer is done)."""

    def __init__(self, path: Path, state: dict, resume: bool) -> None:
        self.path, self.state = Path(path), json.loads(json.dumps(state))  # as the file holds it (lists)
        self.check(resume)

    @classmethod
    def existing(cls, path: Path) -> WorkDir:
        """The work directory at ``path`` that a run has opened (for the processes that calibrate its layers)."""
        path = Path(path)
        return cls(path, json.loads((path / STATE_FILE).read_text()), resume=True)

    def check(self, resume: bool) -> None:
        """A ``ValueError`` unless the directory is new (or empty), or, with ``resume``, holds a run of ``state``."""
        f = self.path / STATE_FILE
        if f.is_file():
            old = json.loads(f.read_text())
            if not resume:
                raise ValueError(f"{self.path} holds an earlier run's layers: pass --resume to continue it, or remove"
                                 " the directory")  # fmt: skip
            diff = sorted(k for k in set(old) | set(self.state) if old.get(k) != self.state.get(k))
            if diff:
                raise ValueError(f"{self.path} holds a run with other {', '.join(diff)}: it cannot be resumed with"
                                 " these settings")  # fmt: skip
        elif self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise ValueError(f"{self.path} exists and is not a quantmla work directory (no {STATE_FILE})")

    def open(self) -> WorkDir:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / STATE_FILE).write_text(json.dumps(self.state, indent=2) + "\n")
        return self

    def tensors(self, index: int) -> Path:
        return self.path / f"layer-{index:03d}.safetensors"

    def result(self, index: int) -> Path:
        return self.path / f"layer-{index:03d}.pt"

    def done(self, index: int) -> bool:
        return self.result(index).is_file()

    def save(self, index: int, changed: dict[str, torch.Tensor], result: dict) -> None:
        from safetensors.torch import save_file

        save_file({n: t.detach().cpu().contiguous() for n, t in changed.items()}, str(self.tensors(index)))
        tmp = self.result(index).with_suffix(".tmp")
        torch.save(result, tmp)
        tmp.rename(self.result(index))

    def load(self, index: int) -> dict:
        # our own file, written by save(): transforms are dataclasses of tensors
        return torch.load(self.result(index), weights_only=False)


def kept(result: dict) -> dict:
    """What stays in memory of a layer's result (its transforms stay in the work directory): the report row and a
    codec method's layer codec, which the export writes."""
    return {"row": result["row"], "codec": result.get("codec"), "fused": result.get("fused") is not None}


def calibrate_layer(model, idx, cfg, train_w, val_w, data_sha, inputs) -> dict:
    """Layer ``idx``'s result: its report row and the method's transforms (or codec, or ``raq-alloc``'s fits)."""
    adapter = get_adapter(model)
    modules = [(i, attn) for i, attn in adapter.attention_modules(model) if i == idx]
    long = layer_stage_windows(cfg, train_w, val_w)[2:] or None
    if cfg.method == "raq-alloc":  # the fits; the allocation needs the whole model (after the layers)
        fits = raq_alloc_fits(inputs, modules, train_w, val_w, cfg, False, tuple(long) if long else None)
        return {"row": {"layer": idx}, "alloc_fits": fits, "codec": None, "fused": None}
    if cfg.method in CODEC_METHODS:
        codec, rows, fused, _ = fit_codec(model, adapter, modules, train_w, val_w, cfg, False,
                                          tuple(long) if long else None, inputs=inputs)  # fmt: skip
        return {"row": rows[0], "codec": codec.layers[0], "fused": fused.get(idx)}
    stage = layer_stage_on(model, adapter, modules, train_w, val_w, cfg, data_sha, inputs)
    return {"row": stage.rows[0], "chosen": stage.chosen[idx], "candidates": stage.candidates[idx]}


def _fusions(idx, cfg, result) -> Fusions:
    """The transforms layer ``idx``'s result fuses into the weights (``{}``: none)."""
    if cfg.method in CODEC_METHODS:
        return {} if result["fused"] is None else {idx: (result["fused"], None)}
    if cfg.method == "rtn":
        return {}
    content, rope = result["chosen"]
    return {idx: (content if "content" in cfg.paths else None, rope if "rope" in cfg.paths else None)}


def finish_layer(model, idx, cfg, result, source, work: WorkDir, start: float) -> None:
    """Fuse layer ``idx``'s transforms into ``model`` and save its changed tensors (against the checkpoint
    ``source``; an FP8 one's fused in float32: :func:`~quantmla.calibrate.checkpoint.fp8_fused_in_float32`) and
    ``result`` in ``work``; log the time since ``start``."""
    fusions = _fusions(idx, cfg, result)
    fuse_transforms(model, {i: c for i, (c, _) in fusions.items() if c is not None},
                    {i: r for i, (_, r) in fusions.items() if r is not None})  # fmt: skip
    prefix = "model.layers.0."

    def rename(n: str) -> str:
        return f"model.layers.{idx}." + n[len(prefix) :]

    named = {rename(n): t for n, t in calibrated_tensor_names(model).items()}
    if source.fp8 is not None and fusions:
        named |= fp8_fused_in_float32(model, fusions, source.path, source.fp8, rename)
    changed = changed_among(named, source.path, source.fp8)
    work.save(idx, changed, result)
    device = next(model.parameters()).device
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if (
        device.type == "cuda") else ""  # fmt: skip
    logger.info("layer %d: %.1f s, %d tensors changed%s", idx, time.perf_counter() - start, len(changed), peak)
