"""``quantmla demo``: the whole cache path on the bundled model, no network needed."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from quantmla.cache import QuantizedLatentCache
from quantmla.cli.errors import check_cache
from quantmla.cli.eval_cmd import results_tables
from quantmla.eval.ppl import PerplexityConfig, perplexity, scheme_label
from quantmla.formats import parse_scheme
from quantmla.measure.tokens import token_windows
from quantmla.models.compat import cache_kwargs
from quantmla.models.latent import enable_latent_attention
from quantmla.models.loading import (
    DEFAULT_MODEL,
    ModelSource,
    builtin_text,
    dtype_name,
    inspect_model,
    load,
    resolve_dtype,
)


@dataclass(frozen=True)
class DemoConfig:
    model: str = DEFAULT_MODEL
    schemes: tuple[str, ...] = ("bf16", "fp8", "c4r4", "c2r4")
    seq_len: int = 512
    num_seqs: int = 12
    prompt_len: int = 320
    new_tokens: int = 48
    sink: int = 4
    recent: int = 128
    seed: int = 0
    calibrate_steps: int = 10  # a short QuantMLA calibration for the last low-bit scheme (0: skip)
    calibrate_seqs: int = 4
    calibrate_model_steps: int = 5  # its model-level stage (the recipe: 150)
    dtype: str = "auto"  # the model's dtype; the demo runs on the CPU, where auto is float32
    group_size: int = 64
    needle_len: int = 2048  # one NIAH example (niah-3: corpus haystack, UUID-like value) per scheme; 0: skip

    def __post_init__(self) -> None:
        if not self.schemes:
            raise ValueError("give at least one scheme; valid: bf16, fp8, c<b>r<b> (e.g. c4r4, c2r4)")
        resolve_dtype(self.dtype, "cpu")
        for s in self.schemes:
            parse_scheme(s)
        if self.calibrate_steps < 0 or self.calibrate_seqs < 1 or self.calibrate_model_steps < 0:
            raise ValueError(
                f"calibrate_steps={self.calibrate_steps} and calibrate_model_steps={self.calibrate_model_steps} "
                f"must be >= 0, calibrate_seqs={self.calibrate_seqs} >= 1"
            )
        for name in ("seq_len", "num_seqs", "prompt_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.needle_len != 0 and self.needle_len < 128:
            raise ValueError(f"needle_len={self.needle_len} must be 0 (skip) or >= 128")


def check(cfg: DemoConfig) -> ModelSource:
    """Everything the demo can check before loading weights: the model and that every scheme fits it."""
    src = inspect_model(cfg.model)
    for name in cfg.schemes:
        check_cache(src, name, cfg.group_size)
    return src


@dataclass(frozen=True)
class GenerationRow:
    scheme: str
    agreement: float
    first_divergence: int | None
    text: str


def generate_side_by_side(model, tokenizer, cfg: DemoConfig) -> list[GenerationRow]:
    prompt = token_windows(tokenizer, builtin_text("test"), cfg.prompt_len, 1)
    rows, baseline = [], None
    for name in cfg.schemes:
        cache = QuantizedLatentCache(
            model.config, scheme=name, group_size=cfg.group_size, sink=cfg.sink, recent=cfg.recent
        )
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=cfg.new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            **cache_kwargs(cache),
        )[:, cfg.prompt_len :]
        baseline = out if baseline is None else baseline
        same = (out == baseline)[0]
        diverged = (~same).nonzero()
        first = int(diverged[0]) if len(diverged) else None
        label = scheme_label(name, dtype_name(model.dtype))
        rows.append(GenerationRow(label, same.float().mean().item(), first, tokenizer.decode(out[0])))
    return rows


def needle_per_scheme(model, tokenizer, cfg: DemoConfig) -> list:
    """One ``niah-3`` example (UUID-like value at 50% depth of a corpus haystack) answered under each scheme, in the
    needle sentence the bundled model was trained on (``templates="legacy"``)."""
    from quantmla.eval.niah import NiahConfig, run_niah

    ncfg = NiahConfig(tasks=("niah-3",), lengths=(cfg.needle_len,), depths=(50,), num_examples=1, seed=cfg.seed,
                      group_size=cfg.group_size, sink=cfg.sink, recent=cfg.recent, templates="legacy")  # fmt: skip
    return run_niah(model, tokenizer, builtin_text("test"), list(cfg.schemes), ncfg, progress=False)


def production_bytes(schemes, contexts=(4096, 131072), sink: int = 4, recent: int = 128) -> list[tuple]:
    """Bytes/token of the allocated storage of a one-layer cache at DeepSeek geometry (latent 512, RoPE 64,
    BF16 windows) holding random values: no such model runs here, and storage size does not depend on values."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(num_hidden_layers=1, kv_lora_rank=512, qk_rope_head_dim=64)
    out = []
    for name in schemes:
        row = [name]
        for ctx in contexts:
            cache = QuantizedLatentCache(cfg, scheme=name, sink=sink, recent=recent)
            for start in range(0, ctx, 8192):
                n = min(8192, ctx - start)
                cache.update(
                    torch.randn(1, 1, n, 512, dtype=torch.bfloat16), torch.randn(1, 1, n, 64, dtype=torch.bfloat16), 0
                )
            row.append(cache.bytes_per_token())
        out.append(tuple(row))
    return out


def generation_table(rows: list[GenerationRow], cfg: DemoConfig) -> Table:
    t = Table(title=f"Greedy generation, {cfg.prompt_len}-token prompt + {cfg.new_tokens} tokens, through "
              "QuantizedLatentCache; same: tokens equal to the first scheme's")  # fmt: skip
    t.add_column("scheme", justify="right", no_wrap=True)
    t.add_column("same", justify="right", no_wrap=True)
    t.add_column("diverges at", justify="right", no_wrap=True)
    t.add_column("continuation", overflow="fold")
    for r in rows:
        first = "-" if r.first_divergence is None else str(r.first_divergence)
        t.add_row(r.scheme, f"{100 * r.agreement:.0f}%", first, r.text.replace("\n", "⏎")[:70])
    return t


def needle_table(rows: list, cfg: DemoConfig) -> Table:
    values = sorted({r.value for r in rows})
    t = Table(
        title=f"One needle per scheme: niah-3 (the UUID-like value {', '.join(values)} in {cfg.needle_len} tokens "
        "of test text, 50% depth, in the needle sentence the model was trained on), the answer decoded greedily "
        "through the cache (`quantmla eval niah` for the full grid, with needles the model never saw)"
    )
    t.add_column("scheme", justify="right", no_wrap=True)
    t.add_column("retrieved", no_wrap=True)
    t.add_column("answer", overflow="fold")
    for r in rows:
        t.add_row(r.scheme, "yes" if r.correct else "no", r.output.strip().replace("\n", "⏎")[:40])
    return t


def production_table(measured: dict[str, tuple], schemes, cfg: DemoConfig, contexts=(4096, 131072)) -> Table:
    """``measured[scheme]``: bytes/token at each of ``contexts`` (``bf16`` among them, the reference)."""
    t = Table(
        title="Bytes/token at DeepSeek geometry (latent 512 + RoPE 64, BF16 windows, sink "
        f"{cfg.sink} + recent {cfg.recent}): allocated storage of a real cache, random values",
        caption="no DeepSeek model runs here: the cache is filled with random tensors (storage size does not "
        "depend on the values); vs bf16: the same cache, scheme bf16",
    )
    t.add_column("scheme", no_wrap=True)
    for ctx in contexts:
        t.add_column(f"{ctx // 1024}K B/token", justify="right", no_wrap=True)
        t.add_column(f"{ctx // 1024}K vs bf16", justify="right", no_wrap=True)
    for name in schemes:
        cells = []
        for i in range(len(contexts)):
            cells += [f"{measured[name][i]:.1f}", f"{measured['bf16'][i] / measured[name][i]:.2f}x"]
        t.add_row(name, *cells)
    return t


def render(cfg: DemoConfig, console: Console, contexts=(4096, 131072)) -> None:
    torch.manual_seed(cfg.seed)
    model, tok = load(check(cfg), dtype=cfg.dtype, device="cpu")
    enable_latent_attention(model)
    param = next(model.parameters())
    console.print(
        f"[bold]quantmla demo[/] - [cyan]{cfg.model}[/] in {dtype_name(param.dtype)} on {param.device}, "
        f"sink {cfg.sink} + recent {cfg.recent}, group {cfg.group_size}; rows without '+quantmla' are RTN "
        "(no transform)"
    )

    def ppl(m, scheme):
        pc = PerplexityConfig(scheme=scheme, seq_len=cfg.seq_len, num_seqs=cfg.num_seqs, sink=cfg.sink,
                              recent=cfg.recent, group_size=cfg.group_size, per_window=True)  # fmt: skip
        return perplexity(m, tok, builtin_text("test"), pc, progress=True)

    results = [ppl(model, s) for s in cfg.schemes]
    low_bit = [s for s in cfg.schemes if parse_scheme(s).content.kind == "int"]
    if cfg.calibrate_steps and low_bit:
        from quantmla.calibrate import calibrate_model

        target = low_bit[-1]
        console.print(
            f"short QuantMLA calibration for {target}: {cfg.calibrate_steps} steps per path and layer, "
            f"{cfg.calibrate_model_steps} model-level steps, on {cfg.calibrate_seqs} sequences (the recipe, "
            "`quantmla calibrate`, uses 300 and 150 steps on 128)"
        )
        calibrated, _ = calibrate_model(
            copy.deepcopy(model), tok, builtin_text("validation"), scheme=target, method="quantmla",
            steps=cfg.calibrate_steps, num_seqs=cfg.calibrate_seqs, val_seqs=2, seq_len=256, progress=True,
            model_steps=cfg.calibrate_model_steps, sink=cfg.sink, recent=cfg.recent, group_size=cfg.group_size,
        )  # fmt: skip
        results.append(dataclasses.replace(ppl(calibrated, target), scheme=f"{target}+quantmla"))
    title = (f"Perplexity on the bundled test split ({cfg.num_seqs} x {cfg.seq_len} tokens), "
             f"{dtype_name(param.dtype)} on {param.device}")  # fmt: skip
    for t in results_tables(title, results):
        console.print(t)
    console.print(generation_table(generate_side_by_side(model, tok, cfg), cfg))
    if cfg.needle_len:
        console.print(needle_table(needle_per_scheme(model, tok, cfg), cfg))
    names = list(cfg.schemes) if "bf16" in cfg.schemes else [*cfg.schemes, "bf16"]
    measured = {row[0]: row[1:] for row in production_bytes(names, contexts, cfg.sink, cfg.recent)}
    console.print(production_table(measured, cfg.schemes, cfg, contexts))
