"""``quantmla demo``: the whole cache path on a tiny MLA model, no network needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from quantmla.cache import QuantizedLatentCache
from quantmla.models import enable_latent_attention, get_adapter
from quantmla.models.compat import cache_kwargs
from quantmla.models.tiny import TINY_CONFIGS, tiny_model
from quantmla.quant import parse_scheme


@dataclass(frozen=True)
class DemoConfig:
    model: str = "deepseek_v3"
    schemes: tuple[str, ...] = ("bf16", "fp8", "c8r8", "c4r4", "c2r4")
    prompt_len: int = 256
    new_tokens: int = 32
    batch: int = 2
    sink: int = 4
    recent: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in TINY_CONFIGS:
            raise ValueError(f"unknown demo model {self.model!r}; valid: {sorted(TINY_CONFIGS)}")
        for s in self.schemes:
            parse_scheme(s)
        for name in ("prompt_len", "new_tokens", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass(frozen=True)
class DemoRow:
    scheme: str
    bytes_per_token: float
    formula_bytes_per_token: float
    agreement: float
    first_divergence: int | None


def run_generation(cfg: DemoConfig) -> tuple[list[DemoRow], dict]:
    model = enable_latent_attention(tiny_model(cfg.model, dtype=torch.bfloat16, seed=cfg.seed))
    dims = get_adapter(model).dims(model.config)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(3, model.config.vocab_size, (cfg.batch, cfg.prompt_len), generator=g)
    rows, baseline = [], None
    for name in cfg.schemes:
        cache = QuantizedLatentCache(model.config, scheme=name, sink=cfg.sink, recent=cfg.recent)
        out = model.generate(
            input_ids=ids,
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=cfg.new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
            **cache_kwargs(cache),
        )[:, cfg.prompt_len :]
        baseline = out if baseline is None else baseline
        same = out == baseline
        diverged = (~same).any(0).nonzero()
        seq = cache.get_seq_length()
        formula = cache.cache_config.expected_nbytes(seq, hp_bytes=2) / seq
        rows.append(
            DemoRow(
                name,
                cache.bytes_per_token(),
                formula,
                same.float().mean().item(),
                int(diverged[0]) if len(diverged) else None,
            )
        )
    return rows, {"kv_lora_rank": dims.kv_lora_rank, "rope_dim": dims.rope_dim, "seq": cfg.prompt_len + cfg.new_tokens}


def production_bytes(schemes, contexts=(4096, 131072), sink: int = 4, recent: int = 128) -> list[tuple]:
    """Bytes/token measured from allocated storage at DeepSeek geometry (latent 512, RoPE 64), one layer."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(num_hidden_layers=1, kv_lora_rank=512, qk_rope_head_dim=64)
    out = []
    for name in schemes:
        row = [name]
        for ctx in contexts:
            cache = QuantizedLatentCache(cfg, scheme=name, sink=sink, recent=recent)
            chunk = 8192
            for start in range(0, ctx, chunk):
                n = min(chunk, ctx - start)
                cache.update(
                    torch.randn(1, 1, n, 512, dtype=torch.bfloat16), torch.randn(1, 1, n, 64, dtype=torch.bfloat16), 0
                )
            row.append(cache.bytes_per_token())
        out.append(tuple(row))
    return out


def render(cfg: DemoConfig, console: Console, contexts=(4096, 131072)) -> None:
    console.print(
        f"[bold]quantmla demo[/] - tiny random [cyan]{cfg.model}[/] model (bf16), batch {cfg.batch}, "
        f"prompt {cfg.prompt_len} + {cfg.new_tokens} greedy tokens, sink {cfg.sink} + recent {cfg.recent}"
    )
    rows, meta = run_generation(cfg)
    t = Table(
        title=f"Generation through the latent cache (latent {meta['kv_lora_rank']}, RoPE {meta['rope_dim']}, "
        f"{meta['seq']} tokens)"
    )
    for col in (
        "scheme",
        "bytes/token (allocated)",
        "bytes/token (formula)",
        "vs bf16",
        "tokens = bf16",
        "first divergence",
    ):
        t.add_column(col, justify="right")
    base = rows[0].bytes_per_token
    for r in rows:
        t.add_row(
            r.scheme,
            f"{r.bytes_per_token:.1f}",
            f"{r.formula_bytes_per_token:.1f}",
            f"{base / r.bytes_per_token:.2f}x",
            f"{100 * r.agreement:.1f}%",
            "-" if r.first_divergence is None else str(r.first_divergence),
        )
    console.print(t)
    prod = production_bytes(cfg.schemes, contexts, cfg.sink, cfg.recent)
    t2 = Table(title="Bytes/token at DeepSeek geometry (latent 512 + RoPE 64), measured from allocated storage")
    t2.add_column("scheme")
    for ctx in contexts:
        t2.add_column(f"{ctx // 1024}K B/token", justify="right")
        t2.add_column(f"{ctx // 1024}K vs bf16", justify="right")
    bf = {ctx: 1152.0 for ctx in contexts}
    for row in prod:
        cells = []
        for i, ctx in enumerate(contexts):
            cells += [f"{row[i + 1]:.1f}", f"{bf[ctx] / row[i + 1]:.2f}x"]
        t2.add_row(row[0], *cells)
    console.print(t2)
    console.print(
        "The model is random, so token agreement measures cache error, not quality; bf16 is the unquantised reference."
    )
