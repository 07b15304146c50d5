"""Perplexity with the quantised latent cache as decode sees it."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from quantmla.cache import LatentCacheConfig, QuantizedLatentCache
from quantmla.formats.codec import ModelCodec, is_quantized, model_codec, scheme_name
from quantmla.formats.scheme import parse_scheme
from quantmla.measure.progress import layer_postfix
from quantmla.measure.simulate import simulated_decode
from quantmla.measure.tokens import all_windows, select_windows
from quantmla.models.adapter import get_adapter
from quantmla.models.compat import cache_kwargs
from quantmla.models.latent import enable_latent_attention, is_latent_attention_enabled
from quantmla.models.loading import dtype_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerplexityConfig:
    scheme: str | ModelCodec = "bf16"  # a scheme name, or a calibrated model's per-layer codec
    seq_len: int = 512
    num_seqs: int | None = None  # None: every full window of the text
    spread: bool = False  # num_seqs windows evenly spaced over the text (False: the first num_seqs)
    sink: int = 4
    recent: int = 128
    group_size: int = 64
    batch_size: int = 8
    kl: bool = False  # also the mean KL(full precision || quantised cache) of the next-token distributions
    per_window: bool = False  # also each window's summed NLL (for paired comparisons between models)

    def __post_init__(self) -> None:
        scheme_name(self.scheme)  # a ValueError naming the valid schemes
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= 2")
        if self.num_seqs is not None and self.num_seqs < 1:
            raise ValueError(f"num_seqs={self.num_seqs} must be >= 1")
        if self.spread and self.num_seqs is None:
            raise ValueError("spread=True picks num_seqs windows: give num_seqs")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be >= 0")


@dataclass(frozen=True)
class PerplexityResult:
    scheme: str  # the scheme's name, or the codec's (method and scheme)
    ppl: float
    nll: float
    tokens: int
    sequences: int
    seq_len: int
    sink: int
    recent: int
    group_size: int
    #: allocated bytes per token and layer of a real QuantizedLatentCache (this scheme, group, sink,
    #: recent) after the model's own prefill of the first evaluated window (see :func:`cache_bytes_per_token`)
    bytes_per_token: float
    unquantised_bytes_per_token: float  # the same, scheme bf16: the latent unquantised, in the model's dtype
    dtype: str  # the model's dtype that ran (e.g. "bfloat16", "float32")
    device: str  # the device that ran (e.g. "cpu", "cuda:0")
    cache_backend: str  # the cache backend(s) whose storage the bytes were read from ("torch", "triton")
    #: 95% bootstrap interval of the perplexity over the evaluated windows (2,000 resamples, seed 0)
    ppl_ci: tuple[float, float] | None = None
    total_windows: int | None = None  # full windows in the text (``sequences`` of them were evaluated)
    kl: float | None = None  # per token, from the same model with a full-precision cache (PerplexityConfig.kl)
    window_nll: list[float] | None = None  # summed NLL of each window (PerplexityConfig.per_window)
    #: effective bits per cached element of the stored (quantised) format, metadata included, from its formula
    #: at the model's latent and RoPE dims (the windows' unquantised tokens not counted)
    bits_per_element: float | None = None

    @property
    def label(self) -> str:
        """The row label: what ran (:func:`scheme_label`)."""
        return scheme_label(self.scheme, self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)


def scheme_label(scheme: str, dtype: str) -> str:
    """``scheme`` as it ran in a model of ``dtype``: the unquantised scheme ``bf16`` holds the latent in the
    model's dtype, so under float32 it is labelled ``unquantised (float32)``; other schemes keep their name."""
    if parse_scheme(scheme.split()[-1].split("+")[0]).quantized or dtype == "bfloat16":
        return scheme
    return f"unquantised ({dtype})"


def paired_bootstrap(base_nll: list[float], other_nll: list[float], tokens_per_window: int,
                     resamples: int = 2000) -> tuple[float, float]:  # fmt: skip
    """95% interval of ``ppl(other) / ppl(base) - 1`` over the same windows, resampled in pairs (seed 0)."""
    d = torch.tensor(other_nll, dtype=torch.float64) - torch.tensor(base_nll, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(d), (resamples, len(d)), generator=g)
    ratio = torch.expm1(d[idx].mean(1) / tokens_per_window)
    lo, hi = torch.quantile(ratio, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def bootstrap_ppl(window_nll: list[float], tokens_per_window: int, resamples: int = 2000) -> tuple[float, float]:
    """95% percentile bootstrap interval of the perplexity, resampling windows (seed 0: deterministic)."""
    x = torch.tensor(window_nll, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(x), (resamples, len(x)), generator=g)
    ppl = torch.exp(x[idx].mean(1) / tokens_per_window)
    lo, hi = torch.quantile(ppl, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def stored_bits_per_element(model_config, cfg: PerplexityConfig) -> float:
    """Bits per cached element of the stored format ``cfg`` describes, metadata included (the windows not
    counted; a per-layer codec: the mean over layers)."""
    adapter = get_adapter(model_config)
    dims = adapter.dims(model_config)
    codec = model_codec(cfg.scheme, adapter.num_cache_layers(model_config))
    return codec.bits_per_element(dims.kv_lora_rank, dims.rope_dim, cfg.group_size)


def cache_config(model_config, cfg: PerplexityConfig) -> list[LatentCacheConfig]:
    """The cache ``cfg`` describes for a model of ``model_config``, one config per layer; a ``ValueError`` (e.g. a
    group size that does not divide the latent) before any forward. Needs the config only, not the weights."""
    adapter = get_adapter(model_config)
    dims = adapter.dims(model_config)
    codec = model_codec(cfg.scheme, adapter.num_cache_layers(model_config))
    return [
        LatentCacheConfig(
            lc.scheme,
            dims.kv_lora_rank,
            dims.rope_dim,
            cfg.group_size,
            cfg.sink,
            cfg.recent,
            codec=lc if lc.fitted else None,
        )  # fmt: skip
        for lc in codec.layers
    ]


def _next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` negative log-likelihood of each next token (the cross-entropy, read off the logits in place:
    no copy of the ``[B, T-1, vocab]`` slice)."""
    head = logits[:, :-1]
    return torch.logsumexp(head, -1) - head.gather(-1, ids[:, 1:, None]).squeeze(-1)


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: bfloat16 promoted to float32, float64 kept (a float64 model's NLL stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.no_grad()
def cache_bytes_per_token(
    model, window: torch.Tensor, scheme: str | ModelCodec, cfg: PerplexityConfig
) -> tuple[float, str]:
    """Prefill ``window [1, T]`` through a real :class:`QuantizedLatentCache` and read its allocated storage:
    ``(bytes per token and layer, backends that held it)``. The storage holds the model's own latents."""
    cache = QuantizedLatentCache(model.config, scheme=scheme, group_size=cfg.group_size, sink=cfg.sink,
                                 recent=cfg.recent)  # fmt: skip
    model(window, use_cache=True, **cache_kwargs(cache))
    backends = ",".join(sorted(set(cache.backends_used())))
    logger.info("bytes/token of %s: %s cache storage after the model's prefill of %d tokens", scheme_name(scheme),
                backends,
                window.shape[1])  # fmt: skip
    return cache.bytes_per_token(), backends


@torch.no_grad()
def perplexity(model, tokenizer, text: str, cfg: PerplexityConfig, progress: bool = True) -> PerplexityResult:
    """Perplexity of ``text`` in windows of ``cfg.seq_len``, each query seeing the cache as decode would.

    The logits come from the one-forward decode-cache simulation (:mod:`quantmla.measure.simulate`); the
    bytes per token from a real cache filled by the model's prefill of the first window."""
    cache_config(model.config, cfg)
    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    every = all_windows(tokenizer, text, cfg.seq_len)
    windows, total_windows = select_windows(every, cfg.num_seqs, cfg.spread), len(every)
    param = next(model.parameters())
    device = param.device
    total, count, kl_sum, per_window = 0.0, 0, 0.0, []
    batches = range(0, len(windows), cfg.batch_size)
    bar = tqdm(batches, desc=f"ppl {scheme_name(cfg.scheme)}", disable=not progress, unit="batch")
    with layer_postfix(model, bar):
        for start in bar:
            x = windows[start : start + cfg.batch_size].to(device)
            with simulated_decode(model, cfg.scheme, cfg.group_size, cfg.sink, cfg.recent):
                logits = _at_least_float32(model(x, use_cache=False).logits)
            nll = _next_token_nll(logits, x).double().sum(1)
            per_window += nll.tolist()
            nll = nll.sum()
            total += float(nll)
            count += x[:, 1:].numel()
            if cfg.kl:  # the reference: every key as computed (the simulation's one causal pass)
                with simulated_decode(model, "bf16", cfg.group_size, cfg.sink, cfg.recent):
                    ref = torch.log_softmax(_at_least_float32(model(x, use_cache=False).logits)[:, :-1], -1)
                out = torch.log_softmax(logits[:, :-1], -1)
                kl_sum += float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="sum"))
    nll = total / count
    first = windows[:1].to(device)
    bpt, backend = cache_bytes_per_token(model, first, cfg.scheme, cfg)
    ref_bpt = bpt if not is_quantized(cfg.scheme) else cache_bytes_per_token(model, first, "bf16", cfg)[0]
    return PerplexityResult(
        scheme=scheme_name(cfg.scheme),
        ppl=math.exp(nll),
        nll=nll,
        tokens=count,
        sequences=len(windows),
        seq_len=cfg.seq_len,
        sink=cfg.sink,
        recent=cfg.recent,
        group_size=cfg.group_size,
        bytes_per_token=bpt,
        unquantised_bytes_per_token=ref_bpt,
        bits_per_element=stored_bits_per_element(model.config, cfg),
        dtype=dtype_name(param.dtype),
        device=str(device),
        cache_backend=backend,
        ppl_ci=bootstrap_ppl(per_window, cfg.seq_len - 1),
        total_windows=total_windows,
        kl=kl_sum / count if cfg.kl else None,
        window_nll=per_window if cfg.per_window else None,
    )
