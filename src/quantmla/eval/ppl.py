"""Perplexity with the quantised latent cache as decode sees it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from quantmla.cache import QuantizedLatentCache
from quantmla.eval.simulate import simulated_decode
from quantmla.models.adapter import get_adapter
from quantmla.models.latent import enable_latent_attention, is_latent_attention_enabled
from quantmla.quant.scheme import parse_scheme


@dataclass(frozen=True)
class PerplexityConfig:
    scheme: str = "bf16"
    seq_len: int = 512
    num_seqs: int | None = None  # None: every full window of the text
    sink: int = 4
    recent: int = 128
    group_size: int = 64
    batch_size: int = 8
    kl: bool = False  # also the mean KL(full precision || quantised cache) of the next-token distributions
    per_window: bool = False  # also each window's summed NLL (for paired comparisons between models)

    def __post_init__(self) -> None:
        parse_scheme(self.scheme)
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= 2")
        if self.num_seqs is not None and self.num_seqs < 1:
            raise ValueError(f"num_seqs={self.num_seqs} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be >= 0")


@dataclass(frozen=True)
class PerplexityResult:
    scheme: str
    ppl: float
    nll: float
    tokens: int
    sequences: int
    seq_len: int
    sink: int
    recent: int
    group_size: int
    bytes_per_token: float  # allocated cache bytes per token and layer at seq_len, BF16 windows
    bf16_bytes_per_token: float
    kl: float | None = None  # per token, from the same model with a full-precision cache (PerplexityConfig.kl)
    window_nll: list[float] | None = None  # summed NLL of each window (PerplexityConfig.per_window)

    def to_dict(self) -> dict:
        return asdict(self)


def token_windows(tokenizer, text: str, seq_len: int, num_seqs: int | None) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}")
    if num_seqs is not None:
        if num_seqs > n:
            raise ValueError(f"num_seqs={num_seqs} but the text holds only {n} windows of {seq_len} tokens")
        n = num_seqs
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def measured_bytes_per_token(config, scheme: str, seq_len: int, sink: int, recent: int, group_size: int) -> float:
    """Fill a real cache with ``seq_len`` BF16 tokens and read its allocated bytes per token and layer."""
    dims = get_adapter(config).dims(config)
    cache = QuantizedLatentCache(config, scheme=scheme, group_size=group_size, sink=sink, recent=recent)
    g = torch.Generator().manual_seed(0)
    for i in range(len(cache.layers)):
        c = torch.randn(1, 1, seq_len, dims.kv_lora_rank, generator=g).to(torch.bfloat16)
        r = torch.randn(1, 1, seq_len, dims.rope_dim, generator=g).to(torch.bfloat16)
        cache.update(c, r, i)
    return cache.bytes_per_token()


@torch.no_grad()
def perplexity(model, tokenizer, text: str, cfg: PerplexityConfig, progress: bool = True) -> PerplexityResult:
    """Perplexity of ``text`` in windows of ``cfg.seq_len``, each query seeing the cache as decode would."""
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    windows = token_windows(tokenizer, text, cfg.seq_len, cfg.num_seqs)
    device = next(model.parameters()).device
    total, count, kl_sum, per_window = 0.0, 0, 0.0, []
    batches = range(0, len(windows), cfg.batch_size)
    for start in tqdm(batches, desc=f"ppl {cfg.scheme}", disable=not progress, unit="batch"):
        x = windows[start : start + cfg.batch_size].to(device)
        with simulated_decode(model, cfg.scheme, cfg.group_size, cfg.sink, cfg.recent):
            logits = model(x, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        nll = nll.view(x.shape[0], -1).double().sum(1)
        per_window += nll.tolist()
        nll = nll.sum()
        total += float(nll)
        count += x[:, 1:].numel()
        if cfg.kl:
            ref = torch.log_softmax(model(x, use_cache=False).logits.float()[:, :-1], -1)
            out = torch.log_softmax(logits[:, :-1], -1)
            kl_sum += float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="sum"))
    nll = total / count
    bpt = measured_bytes_per_token(model.config, cfg.scheme, cfg.seq_len, cfg.sink, cfg.recent, cfg.group_size)
    bf16 = measured_bytes_per_token(model.config, "bf16", cfg.seq_len, cfg.sink, cfg.recent, cfg.group_size)
    return PerplexityResult(
        scheme=cfg.scheme,
        ppl=math.exp(nll),
        nll=nll,
        tokens=count,
        sequences=len(windows),
        seq_len=cfg.seq_len,
        sink=cfg.sink,
        recent=cfg.recent,
        group_size=cfg.group_size,
        bytes_per_token=bpt,
        bf16_bytes_per_token=bf16,
        kl=kl_sum / count if cfg.kl else None,
        window_nll=per_window if cfg.per_window else None,
    )
