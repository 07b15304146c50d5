"""Layer-by-layer calibration of a checkpoint that need not fit the device (DeepSeek-V3: 61 layers, FP8 shards).

One decoder layer at a time is read from the shards onto the device
(:class:`~quantmla.models.streaming.CheckpointLayers`), calibrated on its attention inputs, run once on the kept
hidden states to give the next layer's inputs (:class:`~quantmla.measure.layer_inputs.StreamedInputs`: ``L`` layer
forwards where the in-memory path runs ``L (L + 1) / 2``), its transforms fused, its changed tensors written to the
work directory, and released. Peak device memory is about one layer plus a batch's activations; host memory holds
the calibration windows' hidden states (or none of them, with ``offload="disk"``).

Every per-layer method runs so (:data:`STREAMED_METHODS`), with the same result as in memory: each layer's result
depends only on its inputs, the data, the config and its own random stream. What needs the whole model (QuantMLA's
model-level stage, ``quantmla-raq``, ``raq-alloc``'s allocation) runs in memory after the layers when the model fits
``memory_limit`` (``raq-alloc``'s per-layer fits are made layer by layer, its allocation in memory); when it does not,
``quantmla``'s model stage is skipped (said before any work) and the other two are refused.

Each finished layer's result is a file of the work directory; ``resume=True`` continues an interrupted run from the
first unfinished layer (the earlier layers are run forward again, not calibrated) and gives the same export, bit for
bit, on the same device.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantmla.calibrate.api import (
    QUANTMLA_METHODS,
    CalibrationConfig,
    CalibrationReport,
    LayerStage,
    calibrate_model,
    calibration_windows,
    export_changed,
    layer_stage_windows,
    write_export_meta,
)
from quantmla.calibrate.checkpoint import StoredTensors, write_changed
from quantmla.calibrate.layer_work import WorkDir, calibrate_layer, finish_layer, kept
from quantmla.calibrate.parallel_layers import calibrate_in_parallel
from quantmla.calibrate.related import CODEC_METHODS
from quantmla.formats.codec import ModelCodec
from quantmla.formats.scheme import parse_scheme
from quantmla.measure.layer_inputs import OFFLOAD, StreamedInputs
from quantmla.models.latent import enable_latent_attention
from quantmla.models.loading import load_model, resolve_device
from quantmla.models.streaming import CheckpointLayers

logger = logging.getLogger(__name__)

#: the methods whose every step is per layer
STREAMED_METHODS = ("rtn", "smoothquant", "quarot", "quantmla", "raq", "rolaq", "blockgtq")
#: the methods that need the whole model in memory after (or instead of) the layer-by-layer part
WHOLE_MODEL_METHODS = ("quantmla-raq", "raq-alloc")


@dataclass(frozen=True)
class StreamConfig:
    """Where a layer-by-layer calibration runs: ``device``, the model ``dtype``, where the hidden states wait
    between layers (``offload``: ``cpu`` or ``disk``), the ``work_dir`` of per-layer results, ``resume``,
    and ``memory_limit``: the bytes a whole model may take to run the whole-model stages (``None``: 80% of the
    device's memory). ``devices``: calibrate the layers on these devices at once, one process each
    (:func:`~quantmla.calibrate.parallel_layers.calibrate_in_parallel`;
    ``device`` must be the first of them: the pass that computes each layer's inputs runs there); ``()``: on
    ``device`` alone."""

    device: str = "cpu"
    dtype: str = "auto"
    offload: str = "cpu"
    work_dir: Path | None = None
    resume: bool = False
    memory_limit: int | None = None
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload={self.offload!r}; valid: {', '.join(OFFLOAD)}")
        if self.devices:
            resolved = [str(resolve_device(d)) for d in self.devices]
            if len(resolved) < 2 or len({d.split(":")[0] for d in resolved}) != 1:
                raise ValueError(f"devices={list(self.devices)}: two or more devices of one kind, a process each"
                                 " (e.g. cuda:0,cuda:1)")  # fmt: skip
            if str(resolve_device(self.device)) != resolved[0]:
                raise ValueError(f"device={self.device!r} must be the first of devices={list(self.devices)}")
        if self.memory_limit is not None and self.memory_limit < 0:
            raise ValueError(f"memory_limit={self.memory_limit} must be >= 0 bytes")


def device_memory(device: torch.device) -> int:
    """The memory of ``device`` in bytes (a GPU's total; the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(layers: CheckpointLayers, cfg: CalibrationConfig, limit: int) -> tuple[CalibrationConfig, bool, str]:
    """``(config run, whole-model stage after the layers, what will run)``: a ``ValueError`` before any work for a
    method that needs the whole model when it does not fit ``limit`` bytes."""
    size = layers.model_bytes()
    fits = size <= limit
    need = f"{size / 2**30:.1f} GiB in {str(layers.dtype).removeprefix('torch.')}, limit {limit / 2**30:.1f} GiB"
    if cfg.method in WHOLE_MODEL_METHODS:
        if not fits:
            raise ValueError(f"method {cfg.method} needs the whole model in memory ({need}); layer by layer: "
                             f"{', '.join(STREAMED_METHODS)}")  # fmt: skip
        return cfg, True, f"{cfg.method}: the whole model fits ({need}): calibrated in memory after the layer stage"
    if cfg.method in QUANTMLA_METHODS and cfg.model_steps > 0:
        if fits:
            return cfg, True, f"quantmla's model-level stage runs on the whole model after the layers ({need})"
        return (replace(cfg, model_steps=0), False,
                f"quantmla's model-level stage needs the whole model ({need}): skipped; the layer stage's transforms"
                " are exported")  # fmt: skip
    return cfg, False, f"{cfg.method}: every step per layer"


@dataclass
class StreamedRun:
    """A layer-by-layer calibration checked and ready to run (:func:`prepare_streamed`): nothing read but headers."""

    layers: CheckpointLayers
    config: CalibrationConfig  # as asked
    run_config: CalibrationConfig  # as run (the model-level stage skipped where the model does not fit)
    whole_model: bool
    windows: tuple[torch.Tensor, torch.Tensor, str]
    work: WorkDir
    stream: StreamConfig
    out: Path


def prepare_streamed(source, texts, out: str | Path, tokenizer=None, stream: StreamConfig | None = None,
                     **kwargs) -> StreamedRun:  # fmt: skip
    """Check everything a layer-by-layer calibration needs, before any weight is read: the config, the
    checkpoint's headers, whether the whole-model stages fit, the calibration windows and the work directory
    (``stream.work_dir``, default ``.OUT.quantmla-work`` beside ``out``)."""
    stream = stream or StreamConfig()
    cfg = CalibrationConfig(**kwargs)
    layers = CheckpointLayers(source, stream.dtype, stream.device)
    limit = stream.memory_limit if stream.memory_limit is not None else int(0.8 * device_memory(layers.device))
    run_cfg, whole, what = plan(layers, cfg, limit)
    logger.info("layer by layer on %s (%s, hidden states on %s): %s", layers.device,
                str(layers.dtype).removeprefix("torch."), stream.offload, what)  # fmt: skip
    if tokenizer is None and not isinstance(texts, torch.Tensor):
        from quantmla.models.loading import load_tokenizer

        tokenizer = load_tokenizer(layers.source)
    windows = calibration_windows(tokenizer, texts, cfg)
    top, vocab = int(torch.cat(windows[:2]).max()), layers.config.vocab_size
    if top >= vocab:
        raise ValueError(f"token id {top} is beyond the model's vocab_size {vocab}: not this model's tokens")
    out = Path(out)
    state = {"source": str(layers.source.path.resolve()), "config": asdict(run_cfg), "data_sha256": windows[2],
             "dtype": str(layers.dtype), "device": layers.device.type, "whole_model": whole}  # fmt: skip
    work = WorkDir(stream.work_dir or out.parent / f".{out.name}.quantmla-work", state, stream.resume)
    return StreamedRun(layers, cfg, run_cfg, whole, windows, work, stream, out)


def calibrate_streamed(source, texts, out: str | Path, tokenizer=None, stream: StreamConfig | None = None,
                       copy: bool = False, keep_bf16: bool = False, progress: bool = True,
                       on_layer: Callable[[int], None] | None = None, **kwargs
                       ) -> tuple[CalibrationReport, dict]:  # fmt: skip
    """Calibrate the checkpoint ``source`` layer by layer and export it to ``out`` as the source with its changed
    tensors replaced (:func:`~quantmla.calibrate.checkpoint.write_changed`). ``texts`` and ``kwargs`` as for
    :func:`~quantmla.calibrate.api.calibrate_model`; ``on_layer(index)`` is called after each layer is done.
    Returns ``(report, what was written)``."""
    run = prepare_streamed(source, texts, out, tokenizer, stream, **kwargs)
    return run_streamed(run, copy, keep_bf16, progress, on_layer)


def run_streamed(run: StreamedRun, copy: bool = False, keep_bf16: bool = False, progress: bool = True,
                 on_layer: Callable[[int], None] | None = None) -> tuple[CalibrationReport, dict]:  # fmt: skip
    """Run a :func:`prepare_streamed` calibration: ``(report, what was written)``."""
    layers, cfg, run_cfg = run.layers, run.config, run.run_config
    src = layers.source
    train_w, val_w, data_sha = run.windows
    work = run.work.open()
    per_layer = _stream_layers(layers, run_cfg, train_w, val_w, data_sha, run.stream, work, progress, on_layer)
    if run.whole_model:  # plan() checked that the model fits
        model = load_model(src, dtype=layers.dtype, device=layers.device)
        stage = fits = None
        if cfg.method == "raq-alloc":  # the allocation, on the fits made layer by layer
            fits = _alloc_fits_of(work, sorted(per_layer))
        else:
            stage = _layer_stage_of(run_cfg, data_sha, work, sorted(per_layer))
        windows = torch.cat([train_w, val_w])
        model, report = calibrate_model(model, None, windows, progress=progress, layer_stage=stage, alloc_fits=fits,
                                        **asdict(cfg))  # fmt: skip
        wrote = export_changed(model, src.path, run.out, report, copy=copy, keep_bf16=keep_bf16)
    else:
        report = _report(run_cfg, data_sha, per_layer, src.num_cache_layers)
        files = [work.tensors(i) for i in sorted(per_layer)]
        wrote = write_changed(src.path, run.out, StoredTensors(files),
                              lambda d: write_export_meta(d, report, layers.dtype), copy, keep_bf16)  # fmt: skip
    shutil.rmtree(work.path, ignore_errors=True)
    return report, wrote


def _stream_layers(layers: CheckpointLayers, cfg, train_w, val_w, data_sha, stream: StreamConfig, work: WorkDir,
                   progress, on_layer) -> dict[int, dict]:  # fmt: skip
    """Every layer's result ``{index: {"row", "chosen", "candidates", "codec", "fused"}}``, calibrated in order."""
    windows = layer_stage_windows(cfg, train_w, val_w)
    embedding = layers.embedding()
    scratch = None if stream.offload == "cpu" else work.path / "activations"
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    inputs = StreamedInputs(embedding, windows, cfg.batch_size, stream.offload, scratch)
    del embedding
    if stream.devices:
        try:
            return calibrate_in_parallel(layers, cfg, train_w, val_w, data_sha, inputs, stream.devices, work, progress,
                                         on_layer)  # fmt: skip
        finally:
            inputs.close()
    results: dict[int, dict] = {}
    resumed = sum(work.done(i) for i in range(layers.num_layers))
    if resumed:
        logger.info("resuming: %d of %d layers done in %s (run forward again, not calibrated)", resumed,
                    layers.num_layers, work.path)  # fmt: skip
    bar = tqdm(range(layers.num_layers), desc=f"calibrate {cfg.method} {cfg.scheme} layer by layer", unit="layer",
               disable=not progress)  # fmt: skip
    try:
        for idx in bar:
            start = time.perf_counter()
            model = layers.layer(idx)
            enable_latent_attention(model)
            inputs.set_layer(idx, model)
            if work.done(idx):
                results[idx] = kept(work.load(idx))
                inputs.advance()
                continue
            result = calibrate_layer(model, idx, cfg, train_w, val_w, data_sha, inputs)
            inputs.advance()  # the next layer's inputs, from this layer unfused (fusing keeps its function)
            finish_layer(model, idx, cfg, result, layers.source, work, start)
            results[idx] = kept(result)
            del model, result
            if on_layer is not None:
                on_layer(idx)
    finally:
        inputs.close()
    return results


def _alloc_fits_of(work: WorkDir, indices: list[int]) -> dict[tuple[str, str], list]:
    """``raq-alloc``'s per-layer fits read back from the work directory, as one run over the layers gives them."""
    per = [work.load(i)["alloc_fits"] for i in indices]
    return {key: [fits[key][0] for fits in per] for key in per[0]}


def _layer_stage_of(cfg, data_sha, work: WorkDir, indices: list[int]) -> LayerStage:
    """The layer stage read back from the work directory (for the whole-model stage)."""
    results = {i: work.load(i) for i in indices}
    rows = [results[i]["row"] for i in indices]
    chosen = {i: results[i]["chosen"] for i in indices}
    candidates = {i: results[i]["candidates"] for i in indices}
    return LayerStage(cfg.layer_key(), data_sha, rows, chosen, candidates)


def _report(cfg, data_sha, per_layer: dict[int, dict], num_layers: int) -> CalibrationReport:
    report = CalibrationReport(cfg, data_sha)
    report.layers = [dict(per_layer[i]["row"]) for i in sorted(per_layer)]
    if cfg.method in CODEC_METHODS:
        name = f"{cfg.method} {parse_scheme(cfg.scheme).name}"
        report.codec = ModelCodec(name, tuple(per_layer[i]["codec"] for i in range(num_layers)))
        report.weights_changed = any(per_layer[i]["fused"] for i in per_layer)
    else:  # report.layer_stage stays None: the per-layer transforms are fused in the export
        report.weights_changed = cfg.method != "rtn" and bool(cfg.paths)
    return report
