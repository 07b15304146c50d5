"""``quantmla eval``: quality of a model under a quantised latent cache."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from quantmla.cli.errors import check_out, internal_errors, user_errors
from quantmla.formats.codec import scheme_name
from quantmla.models.loading import (
    DEFAULT_MODEL,
    Placement,
    dtype_name,
    inspect_model,
    load,
    load_text,
    load_tokenizer,
    parse_max_memory,
    resolve_device,
    resolve_dtype,
)

logger = logging.getLogger(__name__)
app = typer.Typer(no_args_is_help=True, help="Evaluate a model under a quantised latent cache.")

DEVICE_DEFAULT = "cuda" if torch.cuda.is_available() else "cpu"
DEVICE_MAP_HELP = ("auto: spread the model over the GPUs, then the host, then disk (accelerate), for a model larger"
                   " than one device; instead of --device.")  # fmt: skip
MAX_MEMORY_HELP = "With --device-map: memory per device, e.g. 0=70GiB,cpu=200GiB (the rest goes to disk)."


@dataclass(frozen=True)
class Where:
    """Where a command runs the model: its placement, the device its dtype is chosen for, and a label."""

    placement: Placement
    device: torch.device

    @property
    def label(self) -> str:
        if self.placement.device_map is None:
            return str(self.device)
        return f"device_map={self.placement.device_map}"


def where_of(device: str, device_map: str | None, max_memory: str | None) -> Where:
    """The placement the options ask for: ``--device``, or ``--device-map`` (and ``--max-memory``)."""
    if device_map is None:
        if max_memory is not None:
            raise ValueError("--max-memory applies to --device-map auto")
        one = resolve_device(device)
        return Where(Placement(str(one)), one)
    if device != DEVICE_DEFAULT:
        raise ValueError(f"give --device ({device}) or --device-map ({device_map}), not both")
    placement = Placement(device_map=device_map, max_memory=parse_max_memory(max_memory))
    return Where(placement, placement.compute_device)


#: tokens `eval ppl` evaluates by default, in windows spread over the text: under a minute a scheme on 2 CPU cores
#: with the bundled model (`--all` for every window)
SUBSET_TOKENS = 24576
#: default window: the model's context, at most this many tokens
MAX_DEFAULT_SEQ_LEN = 4096
DTYPE_HELP = "Model dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32, float64."


@dataclass(frozen=True)
class CacheSettings:
    """The cache an eval command runs: its options where given, else the model's ``quantmla.json`` (an
    export's), else quantmla's defaults (bf16, sink 4, recent 128, groups of 64)."""

    schemes: tuple  # scheme names, or an export's per-layer codec (quantmla.formats.codec.ModelCodec)
    sink: int
    recent: int
    group_size: int


def cache_settings(meta: dict | None, scheme: str | None, sink: int | None, recent: int | None,
                   group_size: int | None, no_sink_recent: bool = False, codec=None) -> CacheSettings:  # fmt: skip
    """:class:`CacheSettings` from the command's options and the model's metadata; a ``ValueError`` naming the
    bad value for a scheme list that names no scheme or an unknown scheme. ``codec``: the export's per-layer
    codec (:func:`quantmla.formats.export.read_codec`), run wherever the export's scheme is (by default, or named
    in ``scheme``); another scheme runs plain, without the fitted parameters (logged)."""
    from quantmla.formats.scheme import parse_scheme

    meta = meta or {}
    text = scheme or meta.get("scheme", "bf16")
    names = tuple(parse_scheme(s.strip()).name for s in text.split(",") if s.strip())
    if not names:
        raise ValueError(f"--scheme {scheme!r} names no scheme; valid: bf16, fp8, c<b>r<b> (e.g. c4r4)")
    if codec is not None:
        own = parse_scheme(meta["scheme"]).name
        for n in names:
            if n != own:
                logger.info("scheme %s runs plain: the export's fitted codec (%s) is for %s", n, codec.name, own)
        names = tuple(codec if n == own else n for n in names)
    sink = meta.get("sink", 4) if sink is None else sink
    recent = meta.get("recent", 128) if recent is None else recent
    if no_sink_recent:
        sink, recent = 0, 0
    return CacheSettings(names, sink, recent, meta.get("group_size", 64) if group_size is None else group_size)


def _pct(x: float) -> str:
    """``x`` in percent, signed: two decimals below 10%, one above (short enough for 80 columns)."""
    return f"{100 * x:+.2f}" if abs(x) < 0.1 else f"{100 * x:+.1f}"


def results_tables(title: str, results) -> list[Table]:
    """Two tables of perplexity rows, each whole at 80 columns (a terminal or a log): perplexity against the
    first row, and the cache's storage. Rows labelled by what ran (:attr:`PerplexityResult.label`)."""
    from quantmla.eval.ppl import paired_bootstrap

    r0 = results[0]
    windows = sorted({f"{r.sink}+{r.recent}" for r in results})
    ppl = Table(
        title=f"{title}; sink+recent {', '.join(windows)}",
        caption=f"ppl: perplexity; vs first: against {r0.label}; paired: the same windows resampled together (a "
        "real difference excludes 0)",
    )
    ppl.add_column("scheme", justify="right", no_wrap=True)
    for col in ("ppl", "95% CI", "vs first", "paired 95% CI"):
        ppl.add_column(col, justify="right", no_wrap=True)
    for r in results:
        paired = "-"
        if r is not r0 and r.window_nll and r0.window_nll:
            lo, hi = paired_bootstrap(r0.window_nll, r.window_nll, r.seq_len - 1)
            paired = f"{_pct(lo)}..{_pct(hi)}%"
        ci = f"{r.ppl_ci[0]:.2f}-{r.ppl_ci[1]:.2f}" if r.ppl_ci else "-"
        ppl.add_row(r.label, f"{r.ppl:.3f}", ci, f"{_pct(r.ppl / r0.ppl - 1)}%", paired)
    store = Table(
        title="Storage of each cache",
        caption="B/token: allocated storage of a QuantizedLatentCache after the model's prefill of the first window "
        "(per token and layer); vs unquantised: the same cache, scheme bf16, in the model's dtype; BPE: bits per "
        "cached element of the stored format, metadata included (formula; the windows not counted)",
    )
    store.add_column("scheme", justify="right", no_wrap=True)
    for col in ("B/token", "vs unquantised", "BPE", "tokens"):
        store.add_column(col, justify="right", no_wrap=True)
    for r in results:
        bpe = "-" if r.bits_per_element is None else f"{r.bits_per_element:.2f}"
        ratio = f"{r.unquantised_bytes_per_token / r.bytes_per_token:.2f}x"
        store.add_row(r.label, f"{r.bytes_per_token:.1f}", ratio, bpe, str(r.tokens))
    return [ppl, store]


@app.command()
def ppl(
    model: str = typer.Argument(DEFAULT_MODEL, help="builtin:NAME, a local model directory, or a cached hub id."),
    scheme: str = typer.Option(
        None,
        "--scheme",
        "-s",
        help="Cache scheme(s), comma-separated: bf16, fp8, c4r4, c2r4, c<b>r<b>, with per-path g<group>, "
        "q<clip percentile>, p<page> or m<b>x<n>-..., and t for TQ-MSE (e.g. c2g128q94r4p128, c4r3t) (default: the "
        "model's quantmla.json "
        "scheme, else bf16).",
    ),
    seq_len: int = typer.Option(
        None, min=2, help=f"Tokens per evaluated window (default: the model's context, at most {MAX_DEFAULT_SEQ_LEN})."
    ),
    num_seqs: int = typer.Option(
        None,
        min=1,
        help=f"Evaluate the first N windows (default: {SUBSET_TOKENS} tokens of windows spread over the text).",
    ),
    all_windows: bool = typer.Option(False, "--all", help="Evaluate every full window of the text."),
    sink: int = typer.Option(None, min=0, help="Leading tokens kept unquantised (default: quantmla.json, else 4)."),
    recent: int = typer.Option(None, min=0, help="Recent tokens kept unquantised (default: quantmla.json, else 128)."),
    no_sink_recent: bool = typer.Option(False, "--no-sink-recent", help="Quantise every token (sink=recent=0)."),
    group_size: int = typer.Option(None, min=1, help="Channels per group (default: quantmla.json, else 64)."),
    batch_size: int = typer.Option(8, min=1, help="Windows per forward."),
    text: Path = typer.Option(None, "--text", help="Evaluate this UTF-8 text file instead of the bundled test split."),
    dataset: Path = typer.Option(None, "--dataset", help="A `datasets` dataset saved with save_to_disk."),
    split: str = typer.Option("test", help="Split of --dataset, or of the bundled text (validation/test)."),
    column: str = typer.Option("text", help="Text column of --dataset."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option(DEVICE_DEFAULT, help="Device: cpu, cuda, cuda:N."),
    device_map: str = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
    max_memory: str = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Perplexity with the cache as decode sees it (sinks and the last `recent` tokens unquantised)."""
    from quantmla.eval.ppl import PerplexityConfig, cache_config, perplexity
    from quantmla.measure import tokens

    with user_errors():  # everything but the forwards is checked before a weight is read
        where = where_of(device, device_map, max_memory)
        dev = where.device
        torch_dtype = resolve_dtype(dtype, dev)
        src = inspect_model(model)
        cs = cache_settings(src.meta, scheme, sink, recent, group_size, no_sink_recent, src.codec)
        if all_windows and num_seqs is not None:
            raise ValueError("give either --all or --num-seqs, not both")
        limit = getattr(src.config, "max_position_embeddings", None) or MAX_DEFAULT_SEQ_LEN
        if seq_len is None:
            seq_len = min(MAX_DEFAULT_SEQ_LEN, limit)
        elif seq_len > limit:
            raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings={limit}")
        subset = not all_windows and num_seqs is None
        n = None if all_windows else max(1, SUBSET_TOKENS // seq_len) if subset else num_seqs
        cfgs = [
            PerplexityConfig(
                scheme=s, seq_len=seq_len, num_seqs=n, spread=subset, sink=cs.sink, recent=cs.recent,
                group_size=cs.group_size, batch_size=batch_size, per_window=True,
            )
            for s in cs.schemes
        ]  # fmt: skip
        for c in cfgs:
            cache_config(src.config, c)
        body = load_text(text, dataset, split, column)
        tokens.select_windows(tokens.all_windows(load_tokenizer(src), body, seq_len), n, subset)  # enough text
    with internal_errors("eval ppl"):
        m, tok = load(src, dtype=torch_dtype, device=dev, placement=where.placement)
        results = [perplexity(m, tok, body, c, progress=True) for c in cfgs]
    if as_json:
        out = {"model": model, "dtype": dtype_name(torch_dtype), "device": where.label}
        typer.echo(json.dumps(out | {"results": [r.to_dict() for r in results]}, indent=2))
        return
    src_text = str(text or dataset or f"bundled {split} split")
    r0 = results[0]
    which = "spread over" if subset else "the first of" if num_seqs is not None else "all of"
    title = (
        f"{model} in {dtype_name(torch_dtype)} on {where.label}: perplexity on {src_text}, {r0.sequences} x {seq_len}"
        f" tokens ({which} its {r0.total_windows} windows{'; --all for every window' if subset else ''})"
    )
    console = Console()
    for t in results_tables(title, results):
        console.print(t)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{what} {text!r}: give a comma list of integers") from None


@app.command()
def niah(
    model: str = typer.Argument(DEFAULT_MODEL, help="builtin:NAME, a local model directory, or a cached hub id."),
    scheme: str = typer.Option(
        None,
        "--scheme",
        "-s",
        help="Cache scheme(s), comma-separated, e.g. bf16,c4r4 (default: the model's quantmla.json scheme, else bf16).",
    ),
    tasks: str = typer.Option("niah-1,niah-2,niah-3", help="Tasks: niah-1, niah-2, niah-3, niah-mk."),
    lengths: str = typer.Option("1024,2048,4096", help="Context lengths in tokens, comma list."),
    depths: str = typer.Option("0,25,50,75,100", help="Needle depths in percent, comma list."),
    num_examples: int = typer.Option(1, "-n", "--num-examples", min=1, help="Examples per cell."),
    seed: int = typer.Option(0, help="Seed of the generated examples."),
    sink: int = typer.Option(None, min=0, help="Leading tokens kept unquantised (default: quantmla.json, else 4)."),
    recent: int = typer.Option(None, min=0, help="Recent tokens kept unquantised (default: quantmla.json, else 128)."),
    group_size: int = typer.Option(None, min=1, help="Channels per group (default: quantmla.json, else 64)."),
    text: Path = typer.Option(None, "--text", help="Haystack text for niah-2/3/mk (default: the bundled test split)."),
    templates: str = typer.Option(
        "heldout",
        help="Needle and question templates: heldout (phrasings and keys no training row uses), train (those training "
        "may use), all (both, reported apart), or legacy (RULER's 'special magic number' sentence alone, the one the "
        "bundled model v2 was trained on: the earlier NIAH results).",
    ),
    out: Path = typer.Option(None, "--out", help="Write niah.json and one heat map PNG per scheme here."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option(DEVICE_DEFAULT, help="Device: cpu, cuda, cuda:N."),
    device_map: str = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
    max_memory: str = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Needle retrieval (RULER-style S-NIAH) with greedy answers through the cache as decode sees it."""
    from quantmla.eval.niah import NiahConfig, accuracy, examples, heatmap, run_niah, tally

    with user_errors():
        where = where_of(device, device_map, max_memory)
        dev = where.device
        torch_dtype = resolve_dtype(dtype, dev)
        src = inspect_model(model)
        cs = cache_settings(src.meta, scheme, sink, recent, group_size, codec=src.codec)
        names = [scheme_name(s) for s in cs.schemes]
        cfg = NiahConfig(
            tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), lengths=_ints(lengths, "lengths"),
            depths=_ints(depths, "depths"), num_examples=num_examples, seed=seed, group_size=cs.group_size,
            sink=cs.sink, recent=cs.recent, templates=templates,
        )  # fmt: skip
        limit = getattr(src.config, "max_position_embeddings", None)
        if limit is not None and max(cfg.lengths) > limit:
            raise ValueError(f"--lengths up to {max(cfg.lengths)} exceed the model's max_position_embeddings={limit}")
        if out is not None:
            check_out(out, overwrite=True)  # niah.json and the heat maps are replaced
        body = load_text(text, None, "test", "text")
        exs = examples(load_tokenizer(src), body, cfg)  # every prompt fits its length
    with internal_errors("eval niah"):
        m, tok = load(src, dtype=torch_dtype, device=dev, placement=where.placement)
        rows = run_niah(m, tok, body, list(cs.schemes), cfg, progress=not as_json, exs=exs)
    splits = sorted({r.split for r in rows})
    result = {"model": model, "dtype": dtype_name(torch_dtype), "device": where.label, "config": cfg.__dict__,
              "accuracy": {s: accuracy(rows, scheme=s) for s in names},
              "accuracy_by_templates": {s: {sp: accuracy(rows, scheme=s, split=sp) for sp in splits} for s in names},
              # [correct, total] over every task and template set: the per-length and per-depth counts
              **{f"by_{f}": {s: {str(k): list(v) for k, v in tally(rows, f, scheme=s).items()} for s in names}
                 for f in ("length", "depth")},
              "rows": [r.to_dict() for r in rows]}  # fmt: skip
    if out is not None:
        with internal_errors("eval niah"):
            out.mkdir(parents=True, exist_ok=True)
            (out / "niah.json").write_text(json.dumps(result, indent=1))
            for s in names:
                heatmap(rows, s, out / f"niah-{s}.png")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    t = Table(title=f"{model} in {dtype_name(torch_dtype)} on {where.label}: NIAH exact match, {cfg.num_examples} per"
              f" cell, depths {','.join(map(str, cfg.depths))}%, sink {cfg.sink} + recent {cfg.recent}, templates"
              f" {cfg.templates}")  # fmt: skip
    t.add_column("scheme")
    t.add_column("task")
    t.add_column("templates")
    for n in cfg.lengths:
        t.add_column(f"{n}", justify="right")
    t.add_column("all", justify="right")
    for s in names:
        for task in cfg.tasks:
            for sp in splits:
                sel = dict(scheme=s, task=task, split=sp)
                if not any(all(getattr(r, k) == v for k, v in sel.items()) for r in rows):
                    continue
                cells = [_cell(rows, **sel, length=n) for n in cfg.lengths]
                t.add_row(s, task, sp, *cells, _cell(rows, **sel))
    Console().print(t)
    d = Table(title="by depth (every task, length and template set): correct of total")
    d.add_column("scheme")
    for depth in cfg.depths:
        d.add_column(f"{depth}%", justify="right")
    for s in names:
        counts = result["by_depth"][s]
        d.add_row(s, *(f"{counts[str(depth)][0]} of {counts[str(depth)][1]}" for depth in cfg.depths))
    Console().print(d)
    if out is not None:
        Console().print(f"wrote {out / 'niah.json'} and {', '.join(f'niah-{s}.png' for s in names)}")


def _cell(rows, **where) -> str:
    from quantmla.eval.niah import accuracy

    sel = [r for r in rows if all(getattr(r, k) == v for k, v in where.items())]
    return f"{100 * accuracy(rows, **where):.0f}%" if sel else "-"


@app.command("lm-eval")
def lm_eval_cmd(
    model: str = typer.Argument(DEFAULT_MODEL, help="builtin:NAME, a local model directory, or a cached hub id."),
    tasks: str = typer.Option(
        ..., "--tasks", "-t", help="lm-eval task names, comma-separated (local ones need --include-path)."
    ),  # fmt: skip
    scheme: str = typer.Option(
        None,
        "--scheme",
        "-s",
        help="Cache scheme(s), comma-separated (default: the model's quantmla.json scheme, else bf16).",
    ),  # fmt: skip
    include_path: Path = typer.Option(None, "--include-path", help="A folder of lm-eval task YAML files."),
    limit: float = typer.Option(None, help="Documents per task (an int), or a fraction of each task (< 1)."),
    num_fewshot: int = typer.Option(None, min=0, help="Few-shot examples (default: the task's)."),
    batch_size: int = typer.Option(1, min=1, help="Requests per forward."),
    sink: int = typer.Option(None, min=0, help="Leading tokens kept unquantised (default: quantmla.json, else 4)."),
    recent: int = typer.Option(None, min=0, help="Recent tokens kept unquantised (default: quantmla.json, else 128)."),
    group_size: int = typer.Option(None, min=1, help="Channels per group (default: quantmla.json, else 64)."),
    seed: int = typer.Option(0, help="Seed of lm-eval's sampling and few-shot choice."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option(DEVICE_DEFAULT, help="Device: cpu, cuda, cuda:N."),
    device_map: str = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
    max_memory: str = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """lm-eval tasks (``HFLM``) with the quantised cache: log-likelihoods and generations both read it."""
    from quantmla.eval.lm_eval_adapter import LmEvalCache, lm_eval_model, run_lm_eval, task_manager

    with user_errors():
        where = where_of(device, device_map, max_memory)
        dev = where.device
        torch_dtype = resolve_dtype(dtype, dev)
        src = inspect_model(model)
        cs = cache_settings(src.meta, scheme, sink, recent, group_size, codec=src.codec)
        task_names = [t.strip() for t in tasks.split(",") if t.strip()]
        if not task_names:
            raise ValueError(f"--tasks {tasks!r} names no task")
        if include_path is not None and not include_path.is_dir():
            raise ValueError(f"--include-path {include_path}: not a folder")
        if limit is not None and (limit <= 0 or (limit >= 1 and limit != int(limit))):
            raise ValueError(f"--limit {limit}: a count (integer >= 1) or a fraction in (0, 1)")
        caches = [LmEvalCache(scheme=s, group_size=cs.group_size, sink=cs.sink, recent=cs.recent) for s in cs.schemes]
        manager = task_manager(task_names, str(include_path) if include_path else None)  # the tasks exist
    with internal_errors("eval lm-eval"):
        m, tok = load(src, dtype=torch_dtype, device=dev, placement=where.placement)
        runs = {}
        for c in caches:
            lm = lm_eval_model(m, tok, c, batch_size=batch_size)
            lim = None if limit is None else (int(limit) if limit >= 1 else limit)
            runs[scheme_name(c.scheme)] = run_lm_eval(lm, task_names, manager=manager, limit=lim,
                                                      num_fewshot=num_fewshot, seed=seed)  # fmt: skip
    caches_json = [c.__dict__ | {"scheme": scheme_name(c.scheme)} for c in caches]
    out = {"model": model, "dtype": dtype_name(torch_dtype), "device": where.label, "limit": limit,
           "caches": caches_json, "runs": runs}  # fmt: skip
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    t = Table(
        title=f"{model} in {dtype_name(torch_dtype)} on {where.label}: lm-eval"
        f"{'' if limit is None else f', limit {limit}'}, sink {caches[0].sink} + recent {caches[0].recent}"
    )
    for col in ("scheme", "task", "metric", "value", "stderr"):
        t.add_column(col, justify="left" if col in ("scheme", "task", "metric") else "right")
    for s, run in runs.items():
        for task, metrics in run["results"].items():
            for key, v in metrics.items():
                if key == "alias" or "_stderr" in key or not isinstance(v, int | float):
                    continue
                name, _, filt = key.partition(",")
                err = metrics.get(f"{name}_stderr,{filt}")
                t.add_row(s, task, key, f"{v:.4f}", f"{err:.4f}" if isinstance(err, int | float) else "-")
    Console().print(t)
