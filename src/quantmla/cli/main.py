"""The ``quantmla`` command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console

from quantmla import __version__
from quantmla.cli import convert_cmd, eval_cmd
from quantmla.cli.errors import check_cache, check_out, internal_errors, parse_layers, user_errors
from quantmla.cli.eval_cmd import DEVICE_DEFAULT, DEVICE_MAP_HELP, DTYPE_HELP, MAX_MEMORY_HELP, where_of
from quantmla.models import loading

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Small and fast low-bit KV caches for Multi-Head Latent Attention (MLA) models.",
)
app.add_typer(eval_cmd.app, name="eval")
app.command(name="convert")(convert_cmd.convert)


def configure_logging() -> None:
    """The command line's logging: quantmla's INFO lines (which path ran, a calibration's plan and per-layer times,
    a resumed run) on stderr, other libraries' warnings. Called by every command (the app's callback), so the
    installed ``quantmla`` script and ``python -m quantmla`` log alike."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("quantmla").setLevel(logging.INFO)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantmla {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """quantmla: quantise the MLA latent cache to 4 or 2 bits."""
    configure_logging()


@app.command()
def demo(
    model: str = typer.Option("builtin:tiny-mla", help="builtin:NAME, a local model directory, or a cached hub id."),
    schemes: str = typer.Option(
        "bf16,fp8,c4r4,c2r4", help="Comma-separated cache schemes; the first is the reference."
    ),
    num_seqs: int = typer.Option(12, min=1, help="Test windows for perplexity."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per window."),
    new_tokens: int = typer.Option(48, min=1, help="Greedy tokens to generate."),
    sink: int = typer.Option(4, min=0, help="Leading tokens kept unquantised."),
    recent: int = typer.Option(128, min=0, help="Most recent tokens kept unquantised."),
    calibrate_steps: int = typer.Option(10, min=0, help="Steps of the short QuantMLA calibration (0: skip)."),
    calibrate_model_steps: int = typer.Option(5, min=0, help="Model-level steps of the short calibration."),
    needle_len: int = typer.Option(2048, min=0, help="Tokens of the one-needle retrieval per scheme (0: skip)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP + " The demo runs on the CPU."),
) -> None:
    """Perplexity, generation, one needle and bytes/token with BF16, FP8 and low-bit latent caches side by side."""
    from quantmla.cli.demo import DemoConfig, check, render

    with user_errors():
        cfg = DemoConfig(
            model=model,
            schemes=tuple(s.strip() for s in schemes.split(",") if s.strip()),
            num_seqs=num_seqs,
            seq_len=seq_len,
            new_tokens=new_tokens,
            sink=sink,
            recent=recent,
            calibrate_steps=calibrate_steps,
            calibrate_model_steps=calibrate_model_steps,
            needle_len=needle_len,
            dtype=dtype,
        )
        check(cfg)
    with internal_errors("demo"):
        render(cfg, Console())


@app.command()
def analyze(
    model: str = typer.Argument("builtin:tiny-mla", help="builtin:NAME, a local model directory, or a cached hub id."),
    num_seqs: int = typer.Option(8, min=1, help="Calibration sequences."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per sequence."),
    shape: str = typer.Option("both", help="Perturbation shape: gaussian, quant or both."),
    quantizer: str = typer.Option(
        "c4r4", help="Scheme whose quantiser residual shapes the 'quant' perturbation: c<b>r<b> (e.g. c4r4, c2r4)."
    ),
    nmse: float = typer.Option(0.01, help="Cache NMSE of each perturbation."),
    probes: int = typer.Option(8, min=1, help="Random probes for the trace and diagonal estimates."),
    batch_size: int = typer.Option(4, min=1, help="Sequences per forward."),
    layers: str = typer.Option(None, help="Comma-separated cache indices (default: all)."),
    seed: int = typer.Option(0, help="Random seed (results are deterministic for a seed)."),
    text: Path = typer.Option(None, "--text", help="Calibration text file (default: bundled validation split)."),
    dataset: Path = typer.Option(None, "--dataset", help="A `datasets` dataset saved with save_to_disk."),
    split: str = typer.Option("validation", help="Split of --dataset or of the bundled text."),
    out: Path = typer.Option(None, "--out", help="Write analysis.json, analysis.csv and analysis.png here."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option(DEVICE_DEFAULT, help="Device: cpu, cuda, cuda:N."),
    device_map: str = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
    max_memory: str = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Dual-path sensitivity: how much each cached path (content latent, RoPE key) moves the attention output."""
    from quantmla.analysis import AnalysisConfig
    from quantmla.analysis import analyze as run_analysis
    from quantmla.analysis.report import table, write
    from quantmla.measure.tokens import token_windows

    shapes = {"both": ("gaussian", "quant"), "gaussian": ("gaussian",), "quant": ("quant",)}
    with user_errors():  # everything but the forwards is checked before a weight is read
        if shape not in shapes:
            raise ValueError(f"--shape {shape!r} unknown; valid: gaussian, quant, both")
        where = where_of(device, device_map, max_memory)
        dev = where.device
        torch_dtype = loading.resolve_dtype(dtype, dev)
        cfg = AnalysisConfig(
            shapes=shapes[shape], quantizer=quantizer, nmse=nmse, probes=probes, batch_size=batch_size, seed=seed
        )
        src = loading.inspect_model(model)
        idx = parse_layers(layers, src.num_cache_layers)
        if "quant" in cfg.shapes:
            check_cache(src, cfg.quantizer, cfg.group_size)
        if out is not None:
            check_out(out, overwrite=True)  # its three files are replaced
        body = loading.load_text(text, dataset, split)
        windows = token_windows(loading.load_tokenizer(src), body, seq_len, num_seqs)
    with internal_errors("analyze"):
        m, _ = loading.load(src, dtype=torch_dtype, device=dev, placement=where.placement)
        report = run_analysis(m, windows, cfg, layers=idx, progress=True)
    title = (
        f"{model} in {loading.dtype_name(torch_dtype)} on {where.label}: responses at cache NMSE {nmse}"
        f" ({num_seqs} x {seq_len} tokens)"
    )
    if out is not None:
        with internal_errors("analyze"):
            write(report, out, title)
    if as_json:
        typer.echo(json.dumps({"model_name": model} | report.to_dict(), indent=2))
        return
    Console().print(table(report, title))
    if out is not None:
        Console().print(f"wrote {out}/analysis.json, analysis.csv, analysis.png")


def _devices(text: str | None) -> tuple[str, ...]:
    """``--devices``: a comma list of devices, or ``all`` (every visible GPU)."""
    import torch

    if text is None:
        return ()
    if text.strip() == "all":
        n = torch.cuda.device_count()
        if n < 2:
            raise ValueError(f"--devices all: {n} GPU visible; it needs two or more")
        return tuple(f"cuda:{i}" for i in range(n))
    return tuple(d.strip() for d in text.split(",") if d.strip())


@app.command()
def calibrate(
    model: str = typer.Argument("builtin:tiny-mla", help="builtin:NAME, a local model directory, or a cached hub id."),
    out: Path = typer.Option(..., "--out", help="Directory for the fused model and quantmla.json (new, or empty)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into --out even if it holds files."),
    copy: bool = typer.Option(
        False, "--copy", help="Copy the source's untouched shards into --out instead of hard-linking them."
    ),
    keep_bf16: bool = typer.Option(
        False, "--keep-bf16", help="FP8 checkpoints: store the changed projections in BF16, not re-quantised to FP8."
    ),
    scheme: str = typer.Option("c4r4", help="Cache scheme to calibrate for (c4r4, c2r4, ...)."),
    method: str = typer.Option(
        "quantmla",
        help="quantmla, rtn, smoothquant, quarot, or a seed paper's method: raq (RAQ-MLA's write-side transforms, "
        "e.g. with --scheme c2g128q94r4p128), blockgtq (Block-GTQ's RoPE widths per layer, e.g. --scheme c4r3t), rolaq "
        "(RoLaQ's refined rotation and learned ranges, e.g. --scheme c2r4); or quantmla-raq: QuantMLA's fused "
        "transforms, then RAQ-MLA's write-side transforms on the fused model (e.g. --scheme c2g128q94r4t); or "
        "raq-alloc: RAQ-MLA's transforms with each layer's formats allocated by held-out KL within the scheme's "
        "bits (e.g. --scheme c2q94r4p64).",
    ),
    steps: int = typer.Option(300, min=0, help="Learning steps per path and layer (quantmla)."),
    model_steps: int = typer.Option(
        150, min=0, help="QuantMLA's model-level steps: all layers jointly against the model's output (0: skip)."
    ),
    model_lr: float = typer.Option(1e-3, min=0.0, help="Learning rate of the model-level stage."),
    model_rotation_lr: float = typer.Option(
        None,
        min=0.0,
        help="Learning rate of the content rotations in the model-level stage (default: --model-lr x 4 / the "
        "latent's width, so a step turns the rotation equally at any width).",
    ),
    model_objective: str = typer.Option("kl", help="Model-level objective: kl (to full precision) or ce."),
    num_seqs: int = typer.Option(128, min=1, help="Calibration sequences."),
    val_seqs: int = typer.Option(32, min=1, help="Held-out sequences (best step)."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per sequence."),
    model_seq_len: int = typer.Option(
        None,
        min=2,
        help="Tokens per sequence of the model-level stage (and of RAQ-MLA's post-RoPE fit unless --rope-fit-seq-len): "
        "consecutive sequences "
        "joined (default: --seq-len; e.g. 4096 to calibrate at the context you serve).",
    ),  # fmt: skip
    rope_fit_seq_len: int = typer.Option(
        None,
        min=2,
        help="Tokens per sequence of RAQ-MLA's post-RoPE fit (raq, raq-alloc, quantmla-raq; default: --model-seq-len).",
    ),  # fmt: skip
    batch_size: int = typer.Option(4, min=1, help="Sequences per forward."),
    sink: int = typer.Option(4, min=0, help="Sink tokens kept unquantised (recorded for decode)."),
    recent: int = typer.Option(128, min=0, help="Recent tokens kept unquantised (recorded for decode)."),
    no_sink_recent: bool = typer.Option(False, "--no-sink-recent", help="Record sink=recent=0."),
    seed: int = typer.Option(0, help="Random seed."),
    text: Path = typer.Option(None, "--text", help="Calibration text file (default: bundled validation split)."),
    dataset: Path = typer.Option(None, "--dataset", help="A `datasets` dataset saved with save_to_disk."),
    split: str = typer.Option("validation", help="Split of --dataset or of the bundled text."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option(DEVICE_DEFAULT, help="Device: cpu, cuda, cuda:N."),
    sequential: bool = typer.Option(
        False,
        "--sequential",
        help="Layer by layer from the checkpoint's shards: one decoder layer on the device at a time, each layer's "
        "inputs computed once (for models larger than the device; DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash).",
    ),
    offload: str = typer.Option(
        None, help="With --sequential: where the calibration windows' hidden states wait between layers: cpu, disk."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="With --sequential: continue an interrupted run from its work directory."
    ),
    work_dir: Path = typer.Option(
        None, "--work-dir", help="With --sequential: per-layer results (default: .OUT.quantmla-work beside --out)."
    ),
    devices: str = typer.Option(
        None,
        "--devices",
        help="With --sequential: calibrate the layers at once on these devices, a process each (e.g. cuda:0,cuda:1;"
        " all: every visible GPU); each layer's inputs are computed on the first.",
    ),
) -> None:
    """Learn (or set) fusable per-path transforms, fuse them into the weights, export a model directory."""
    import torch
    from rich.table import Table

    from quantmla.calibrate import CalibrationConfig, calibrate_model
    from quantmla.calibrate.api import calibration_windows, export_changed
    from quantmla.calibrate.streamed import StreamConfig, prepare_streamed, run_streamed

    if no_sink_recent:
        sink, recent = 0, 0
    kwargs = dict(
        scheme=scheme, method=method, steps=steps, num_seqs=num_seqs, val_seqs=val_seqs, seq_len=seq_len,
        batch_size=batch_size, sink=sink, recent=recent, seed=seed, model_steps=model_steps, model_lr=model_lr,
        model_rotation_lr=model_rotation_lr, model_objective=model_objective, model_seq_len=model_seq_len,
        rope_fit_seq_len=rope_fit_seq_len,
    )  # fmt: skip
    with user_errors():  # every input is checked before a weight is read
        spread = _devices(devices)
        dev = loading.resolve_device(spread[0] if spread and device == DEVICE_DEFAULT else device)
        torch_dtype = loading.resolve_dtype(dtype, dev)
        cfg = CalibrationConfig(**kwargs)
        check_out(out, overwrite)
        src = loading.inspect_model(model)
        if keep_bf16 and src.fp8 is None:
            raise ValueError(f"--keep-bf16 applies to an FP8 checkpoint; {src.path} is unquantised")
        check_cache(src, cfg.scheme, cfg.group_size)
        if not sequential and (offload is not None or resume or work_dir is not None or devices is not None):
            raise ValueError("--offload, --resume, --work-dir and --devices apply to --sequential calibration")
        body = loading.load_text(text, dataset, split)
        train_w, val_w, _ = calibration_windows(loading.load_tokenizer(src), body, cfg)  # enough text for the windows
        top, vocab = int(torch.cat([train_w, val_w]).max()), src.config.vocab_size
        if top >= vocab:
            raise ValueError(f"the tokenizer of {src.path} gives token id {top}, beyond the model's vocab_size"
                             f" {vocab}: it is not this model's tokenizer")  # fmt: skip
        if sequential:
            stream = StreamConfig(str(dev), loading.dtype_name(torch_dtype), offload or "cpu", work_dir, resume,
                                  devices=spread)  # fmt: skip
            run = prepare_streamed(src, torch.cat([train_w, val_w]), out, stream=stream, **kwargs)
    with internal_errors("calibrate"):
        if sequential:
            report, wrote = run_streamed(run, copy=copy, keep_bf16=keep_bf16)
        else:
            m, tok = loading.load(src, dtype=torch_dtype, device=dev)
            m, report = calibrate_model(m, tok, torch.cat([train_w, val_w]), **kwargs)
            wrote = export_changed(m, src.path, out, report, copy=copy, keep_bf16=keep_bf16)
    t = Table(
        title=f"{method} {scheme} ({loading.dtype_name(torch_dtype)} on {dev}): held-out error per layer"
        " (before -> after)"
    )
    for col in ("layer", "content", "RoPE"):
        t.add_column(col, justify="right")
    for row in report.layers:
        t.add_row(str(row["layer"]), *(_layer_cell(row.get(path, {})) for path in ("content", "rope")))
    Console().print(t)
    ml = report.model_level
    if ml is not None:
        Console().print(
            f"model level ({ml['objective']}, sink {ml['sink']} + recent {ml['recent']}): held-out "
            + ", ".join(f"{k} {v:.3e}" for k, v in ml["start_val"].items())
            + f"; start {ml['init']} -> {ml['val_after']:.3e} at step {ml['best_step']}"
        )
    if report.codec is not None:
        weights = "transforms fused into the weights" if report.weights_changed else "weights unchanged"
        Console().print(f"{method}: {weights}; the per-layer cache codec is {out}/quantmla/codec.safetensors")
    Console().print(
        f"wrote {out}: {len(wrote['changed'])} tensors changed, {len(wrote['rewritten'])} shards rewritten,"
        f" {len(wrote['linked'])} {'copied' if copy else 'hard-linked'} from the source (load it with transformers,"
        f" or run `quantmla eval ppl {out}`)"
    )


def _layer_cell(path_row: dict) -> str:
    """One path of a layer's report row: held-out error before -> after, or the format it was given."""
    if "val_after" in path_row:
        return f"{path_row['val_before']:.4g} -> {path_row['val_after']:.4g}"
    return path_row.get("format", "-")


if __name__ == "__main__":
    app()
