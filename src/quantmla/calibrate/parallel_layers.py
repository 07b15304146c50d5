"""A layer-by-layer calibration spread over several devices: the layers calibrated at once, one process a device.

Each layer's result depends only on its inputs (the previous layers run unfused), the data, the config and its own
random stream (:mod:`quantmla.calibrate.layer_work`). So one pass on the first device computes every layer's inputs
in order (a forward of each layer: ``L`` layer forwards, as the one-device run) and writes each to the work
directory; as each is written, the next free process (one a device, ``StreamConfig.devices``) reads that layer from
the checkpoint onto its device, calibrates it on those inputs, fuses, saves its result and deletes the inputs. The
export is the one-device run's, bit for bit on devices of the same kind; a device map over GPUs in the sense of
this pipeline: the GPUs share the layers, each layer whole on one GPU.

Disk: the inputs of at most two layers a process wait there (each the calibration windows' hidden states, about
1.2 GB a layer at DeepSeek-V3's width in BF16). The first device holds a layer for the inputs pass beside its own
process's layer (at V3's width about 22 + 34 GB).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import shutil
import time
import traceback
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantmla.calibrate.layer_work import WorkDir, calibrate_layer, finish_layer, kept
from quantmla.measure.layer_inputs import StreamedInputs
from quantmla.models.latent import enable_latent_attention
from quantmla.models.streaming import CheckpointLayers

logger = logging.getLogger(__name__)


def inputs_dir(work: WorkDir, idx: int) -> Path:
    """Where layer ``idx``'s inputs wait for the process that calibrates it."""
    return work.path / f"inputs-{idx:03d}"


def calibrate_in_parallel(layers: CheckpointLayers, cfg, train_w, val_w, data_sha, inputs: StreamedInputs,
                          devices: tuple[str, ...], work: WorkDir, progress: bool,
                          on_layer) -> dict[int, dict]:  # fmt: skip
    """Every layer's result ``{index: kept result}``: the inputs pass on ``layers.device`` (``inputs`` at layer 0),
    the calibrations on ``devices``, one process each."""
    ctx = multiprocessing.get_context("spawn")
    todo, done = ctx.Queue(), ctx.Queue()
    # on the host a reduction's order follows the thread count: the processes take this one's (the same results)
    args = (
        str(layers.source.path),
        str(layers.dtype).removeprefix("torch."),
        cfg,
        train_w,
        val_w,
        data_sha,
        str(work.path),
        todo,
        done,
        torch.get_num_threads(),
        logging.getLogger("quantmla").getEffectiveLevel(),
    )
    procs = [ctx.Process(target=_worker, args=(d, *args), daemon=True) for d in devices]
    for p in procs:
        p.start()
    logger.info("layer by layer on %d devices (%s): the inputs pass on %s, the layers calibrated at once",
                len(devices), ", ".join(devices), layers.device)  # fmt: skip
    bar = tqdm(total=layers.num_layers, desc=f"calibrate {cfg.method} {cfg.scheme} on {len(devices)} devices",
               unit="layer", disable=not progress)  # fmt: skip
    results: dict[int, dict] = {}
    waiting = 0
    try:
        for idx in range(layers.num_layers):
            model = layers.layer(idx)
            enable_latent_attention(model)  # the layer computes as in the one-device run
            inputs.set_layer(idx, model)
            if work.done(idx):
                results[idx] = kept(work.load(idx))
                bar.update()
            else:
                while waiting >= 2 * len(procs):  # at most two layers' inputs a process wait on disk
                    waiting -= _collect(done, procs, results, work, bar, on_layer, block=True)
                shutil.rmtree(inputs_dir(work, idx), ignore_errors=True)  # a partial one of an interrupted run
                inputs.snapshot(inputs_dir(work, idx))
                todo.put(idx)
                waiting += 1
            inputs.advance()
            del model
            waiting -= _collect(done, procs, results, work, bar, on_layer, block=False)
        for _ in procs:
            todo.put(None)
        while waiting:
            waiting -= _collect(done, procs, results, work, bar, on_layer, block=True)
    finally:
        bar.close()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return results


def _collect(done, procs, results, work: WorkDir, bar, on_layer, block: bool) -> int:
    """Take the finished layers' messages (waiting for one with ``block``); a worker's error raised here."""
    n = 0
    while True:
        try:
            idx, error = done.get(timeout=1.0) if block and n == 0 else done.get_nowait()
        except queue.Empty:
            if block and n == 0:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a layer calibration process died (exit code {dead[0].exitcode})") from None
                continue
            return n
        if error is not None:
            raise RuntimeError(f"calibrating layer {idx} failed in its process:\n{error}")
        results[idx] = kept(work.load(idx))
        bar.update()
        n += 1
        if on_layer is not None:
            on_layer(idx)


def _worker(device, source, dtype, cfg, train_w, val_w, data_sha, work_path, todo, done, threads, level) -> None:
    """One device's process: calibrate the layers it is handed until it is handed ``None``; its log lines (each
    layer's time) at the parent's level, named by the device."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=level, format=f"[{device}] %(name)s: %(message)s")
    logging.getLogger("quantmla").setLevel(level)
    work = WorkDir.existing(Path(work_path))
    layers = CheckpointLayers(source, dtype, device)
    while (idx := todo.get()) is not None:
        try:
            start = time.perf_counter()
            inputs = StreamedInputs.from_snapshot(inputs_dir(work, idx))
            model = layers.layer(idx)
            enable_latent_attention(model)
            inputs.set_layer(idx, model)
            result = calibrate_layer(model, idx, cfg, train_w, val_w, data_sha, inputs)
            finish_layer(model, idx, cfg, result, layers.source, work, start)
            shutil.rmtree(inputs_dir(work, idx), ignore_errors=True)
            del model, result, inputs
            done.put((idx, None))
        except BaseException:  # noqa: BLE001 (reported to the main process, which raises it)
            done.put((idx, traceback.format_exc()))
            return
