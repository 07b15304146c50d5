"""``QuantizedLatentCache``: a transformers ``Cache`` holding the MLA latent in packed low-bit form.

Per cache layer and sequence the tokens live in three stores, in position order, sized by the window
policy (:class:`~quantmla.formats.windows.WindowPolicy`):

* the first ``sink`` tokens, unquantised;
* the middle, quantised once when a token leaves the recent window (:class:`PathStore`);
* the last ``recent`` tokens, unquantised.

Content latent and RoPE key are stored separately, each in its scheme's format. ``update``
returns the whole cached sequence for one softmax over all tokens. This is the reference torch
path: quantised tokens are dequantised and then attended.

Position policy: a decode step (one new token) sees exactly what the stores hold. A multi-token
update (prefill, chunked prefill) attends its *own* new tokens at full precision, as they were
computed, and stores them quantised for later steps; earlier tokens are seen as stored.

Rollback (assisted / speculative decoding): ``crop(-k)`` removes the last ``k`` tokens and leaves the cache exactly
as if they had never been appended, tokens they pushed out of the recent window back unquantised. While past
recording is on (``activate_past_recording()``, which transformers calls before assisted decoding) each layer keeps
the unquantised copies of the tokens that leave the window until the next ``crop``; a crop that would need a token
quantised before that raises (one message, nothing changed), never returns a silently different cache.

``hp_dtype`` (the unquantised windows) defaults to the dtype of the model's activations, which is
BF16 in production; byte counts are measured from the allocated tensors either way.

Validation: the tokens of a multi-token update (prefill) are checked once (finite, and inside the fp16
range of the scales of an integer path), which reads values back to the host. Decode steps (one new
token) are not checked, so a step makes no GPU->CPU sync and can be captured in a CUDA graph, unless
the cache is built with ``validate=True`` (a debug mode: every update is checked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from quantmla.cache.paged_store import PagedPathStore
from quantmla.cache.store import PathStore, TransformedStore
from quantmla.formats.codec import LayerCodec, PathCodec, model_codec
from quantmla.formats.scheme import CacheScheme, PathFormat
from quantmla.formats.windows import WindowPolicy
from quantmla.models import families  # noqa: F401  (registers the adapters)
from quantmla.models.adapter import MLADims, get_adapter
from quantmla.quant.affine import check_finite, check_group, check_quantizable
from quantmla.quant.fp8 import FP8_TILE

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class LatentCacheConfig:
    scheme: CacheScheme
    kv_lora_rank: int
    rope_dim: int
    group_size: int = 64
    sink: int = 4
    recent: int = 128
    page_size: int = 64
    hp_dtype: torch.dtype | None = None
    validate: bool = False
    #: what a calibration method fitted for this layer (write-side transforms, learned ranges); its scheme is
    #: ``scheme``. ``None``: the plain scheme
    codec: LayerCodec | None = None

    def __post_init__(self) -> None:
        if self.codec is not None:
            if self.codec.scheme.name != self.scheme.name:
                raise ValueError(f"codec of scheme {self.codec.scheme.name!r} in a cache layer of {self.scheme.name!r}")
            self.codec.content.check(self.kv_lora_rank, self.group_size)
            self.codec.rope.check(self.rope_dim, self.group_size)
        if not isinstance(self.validate, bool):
            raise ValueError(f"validate={self.validate!r} must be True or False")
        WindowPolicy(self.sink, self.recent)  # validates
        if self.page_size <= 0:
            raise ValueError(f"page_size={self.page_size} must be positive")
        for fmt, dim, what in (
            (self.scheme.content, self.kv_lora_rank, "content latent"),
            (self.scheme.rope, self.rope_dim, "RoPE key"),
        ):
            if fmt.kind == "int":
                try:
                    check_group(dim, fmt.group_size(self.group_size))
                    if fmt.channel_bits is not None and len(fmt.channel_bits) != dim:
                        raise ValueError(f"{len(fmt.channel_bits)} channel widths for {dim} channels")
                except ValueError as e:
                    raise ValueError(f"{what}: {e}") from None
            if fmt.kind == "fp8" and dim % FP8_TILE:
                raise ValueError(f"{what} dim {dim} is not a multiple of the FP8 tile {FP8_TILE}")

    @property
    def windows(self) -> WindowPolicy:
        """Which positions decode reads unquantised (``sink`` first, ``recent`` last)."""
        return WindowPolicy(self.sink, self.recent)

    def persistent_bytes_per_token(self) -> int:
        """Formula bytes of one quantised token (both paths), for comparison with the measured bytes."""
        return self.scheme.bytes_per_token(self.kv_lora_rank, self.rope_dim, self.group_size)


def check_tokens(cfg: LatentCacheConfig, c: torch.Tensor, r: torch.Tensor) -> None:
    """Raise unless latent ``c`` and RoPE key ``r`` can be stored in ``cfg.scheme`` (GPU syncs)."""
    for fmt, x, what in ((cfg.scheme.content, c, "content latent"), (cfg.scheme.rope, r, "RoPE key")):
        if fmt.kind == "int":
            check_quantizable(x, what)
        elif fmt.kind == "fp8":
            check_finite(x, what)


class QuantizedLatentLayer(DynamicLayer):
    """One MLA layer of the cache (subclasses DynamicLayer for transformers' bookkeeping).

    ``keys`` / ``values`` are the content latent and the RoPE key of every cached token,
    ``[B, 1, L, d]`` in the windows' dtype: for the ``bf16`` scheme exactly the stored values, for a
    quantised scheme the tokens as a decode step reads them (sinks and recent window as stored, the
    middle dequantised). They are computed on each access (a dequantisation, not a stored tensor) and
    cannot be assigned.
    """

    is_croppable = True

    def __init__(self, cfg: LatentCacheConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.seen = 0
        #: transformers' flag (``Cache.is_recording_past`` reads it): while set, the tokens that leave the recent
        #: window are also kept unquantised until the next ``crop``, so that ``crop`` can undo their eviction
        self.record_past = False
        #: (latent, RoPE key) of the tokens that left the window since the checkpoint, while recording
        self.recorded_evictions: tuple[torch.Tensor, torch.Tensor] | None = None
        self.verify_noted = False  # the verify-step warning was logged (layer 0, once)

    @property
    def keys(self) -> torch.Tensor | None:
        return self._view(self.hp_dtype)[0].unsqueeze(1) if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("QuantizedLatentLayer.keys is a read-only view of the stored latent")

    @property
    def values(self) -> torch.Tensor | None:
        return self._view(self.hp_dtype)[1].unsqueeze(1) if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("QuantizedLatentLayer.values is a read-only view of the stored RoPE key")

    # -- transformers layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.cfg
        self.dtype, self.device = key_states.dtype, key_states.device
        self.hp_dtype = cfg.hp_dtype or key_states.dtype
        b = key_states.shape[0]
        hp = PathFormat("bf16")

        def store(fmt: PathFormat, dim: int, page: int, path: str) -> PathStore:
            return PathStore(fmt, dim, cfg.group_size, b, self.hp_dtype, self.device, page, path=path)

        sink_page = max(cfg.sink, 1)  # the sink store never grows past `sink` tokens: allocate exactly
        self.sink_c = store(hp, cfg.kv_lora_rank, sink_page, "c")
        self.sink_r = store(hp, cfg.rope_dim, sink_page, "r")
        self._init_mid(b)
        self.batch = b
        self.rec_c = torch.empty(b, 0, cfg.kv_lora_rank, dtype=self.hp_dtype, device=self.device)
        self.rec_r = torch.empty(b, 0, cfg.rope_dim, dtype=self.hp_dtype, device=self.device)
        self.is_initialized = True
        self._set_mid_recording(self.record_past)

    def _split(self, total: int) -> tuple[int, int]:
        """``(sinks, recent)``: tokens the unquantised stores hold once the layer has ``total`` (the policy's
        split; the rest are the middle). A bf16 scheme keeps every token as computed, in the recent store."""
        if not self.cfg.scheme.quantized:
            return 0, total
        n_sink, _, n_recent = self.cfg.windows.split(total)
        return n_sink, n_recent

    # -- the middle (quantised) store: overridden by the kernel-backed layer ------------------
    def _init_mid(self, batch: int) -> None:
        cfg = self.cfg

        def store(fmt: PathFormat, dim: int, path: PathCodec | None, role: str):
            if fmt.page is not None:  # per channel within pages of fmt.page tokens
                inner = PagedPathStore(fmt, dim, batch, self.hp_dtype, self.device, cfg.page_size)
            else:
                ranges = None if path is None or path.clip_ratio is None else (path.clip_ratio, path.gain)
                inner = PathStore(fmt, dim, cfg.group_size, batch, self.hp_dtype, self.device, cfg.page_size, ranges,
                                  path=role)  # fmt: skip
            return inner if path is None or path.transform is None else TransformedStore(inner, path)

        codec = cfg.codec
        self.mid_c = store(cfg.scheme.content, cfg.kv_lora_rank, None if codec is None else codec.content, "c")
        self.mid_r = store(cfg.scheme.rope, cfg.rope_dim, None if codec is None else codec.rope, "r")

    def _append_mid(self, c: torch.Tensor, r: torch.Tensor) -> None:
        """Quantise and store tokens leaving the recent window (checked in ``update`` already)."""
        self.mid_c.append(c, check=False)
        self.mid_r.append(r, check=False)

    def _mid_view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mid_c.dequantize(dtype), self.mid_r.dequantize(dtype)

    def _mid_nbytes(self) -> int:
        """Allocated bytes of the quantised middle (whole pages of ``page_size`` tokens)."""
        return self.mid_c.nbytes() + self.mid_r.nbytes()

    def _view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token as stored, the quantised ones dequantised: ``[B, L, d_c]``, ``[B, L, d_r]``."""
        mc, mr = self._mid_view(dtype)
        out_c = torch.cat([self.sink_c.dequantize(dtype), mc, self.rec_c.to(dtype)], dim=1)
        out_r = torch.cat([self.sink_r.dequantize(dtype), mr, self.rec_r.to(dtype)], dim=1)
        return out_c, out_r

    def _result(self, c: torch.Tensor, r: torch.Tensor, s: int):
        """What ``update`` returns: every cached token, the new ones as computed when ``s > 1``."""
        out_c, out_r = self._view(c.dtype)
        if s > 1:  # the new tokens of a multi-token update are attended as computed
            out_c[:, -s:] = c
            out_r[:, -s:] = r
        return out_c.unsqueeze(1), out_r.unsqueeze(1)

    def _check(self, c: torch.Tensor, r: torch.Tensor) -> None:
        cfg = self.cfg
        if c.dim() != 4 or c.shape[1] != 1 or c.shape[-1] != cfg.kv_lora_rank or r.shape[-1] != cfg.rope_dim:
            raise ValueError(
                f"cache layer {self.layer_idx} was built for latent dim {cfg.kv_lora_rank} and RoPE dim "
                f"{cfg.rope_dim} ([batch, 1, tokens, dim]); got latent {tuple(c.shape)} and RoPE key "
                f"{tuple(r.shape)}: was the cache built for another model?"
            )
        if self.is_initialized and c.shape[0] != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {c.shape[0]} within one cache")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new latent ``[B,1,S,d_c]`` and RoPE key ``[B,1,S,d_r]``; return all cached tokens."""
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c, r = key_states[:, 0], value_states[:, 0]
        s = c.shape[1]
        if s > 1 or self.cfg.validate:  # once at prefill; per token only in the debug mode (GPU syncs)
            check_tokens(self.cfg, c, r)
        if s > 1 and self.record_past:
            self._note_verify_step(s)
        sinks, recent = self._split(self.seen + s)
        n_sink = sinks - self.sink_c.length  # new tokens that are sinks (they come first)
        self.sink_c.append(c[:, :n_sink], check=False)
        self.sink_r.append(r[:, :n_sink], check=False)
        self.rec_c = torch.cat([self.rec_c, c[:, n_sink:].to(self.hp_dtype)], dim=1)
        self.rec_r = torch.cat([self.rec_r, r[:, n_sink:].to(self.hp_dtype)], dim=1)
        overflow = self.rec_c.shape[1] - recent  # the oldest recent tokens leave the window: quantised once
        if overflow > 0:
            self._record_eviction(self.rec_c[:, :overflow], self.rec_r[:, :overflow])
            self._append_mid(self.rec_c[:, :overflow], self.rec_r[:, :overflow])
            self.rec_c, self.rec_r = self.rec_c[:, overflow:].clone(), self.rec_r[:, overflow:].clone()
        self.seen += s
        return self._result(c, r, s)

    def _note_verify_step(self, s: int) -> None:
        """Say once (layer 0) when a recorded multi-token step, assisted decoding's verify, reads other precisions
        than token-by-token decode would: it follows the prefill policy (its own tokens as computed, earlier ones as
        stored), which differs once the request is longer than the windows."""
        cfg = self.cfg
        if self.layer_idx or self.verify_noted or not cfg.scheme.quantized or self.seen + s <= cfg.sink + cfg.recent:
            return
        self.verify_noted = True
        logger.warning(
            "quantmla cache %s: a recorded step of %d tokens at %d (assisted decoding's verify) reads with the prefill "
            "policy (its own tokens as computed, earlier ones as stored); past the %d + %d windows that differs from "
            "token-by-token decode, so its tokens can differ from plain greedy decoding through this cache",
            cfg.scheme.name, s, self.seen, cfg.sink, cfg.recent,
        )  # fmt: skip

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self.is_initialized = False
        self.recorded_evictions = None

    # -- rollback (assisted / speculative decoding) ------------------------------------------------------
    def activate_past_recording(self, **kwargs) -> None:
        """From now until each ``crop``, keep the tokens leaving the recent window unquantised as well, so that
        ``crop`` can remove tokens appended meanwhile exactly (transformers calls this before assisted decoding;
        keyword arguments, e.g. ``recurrent_states_to_keep``, concern other layer kinds)."""
        self.record_past = True
        self._checkpoint()

    def _checkpoint(self) -> None:
        """Forget what was recorded: later crops can undo only what is appended from here on."""
        self.recorded_evictions = None
        if self.is_initialized:
            self._set_mid_recording(self.record_past)

    def _set_mid_recording(self, on: bool) -> None:
        self.mid_c.set_recording(on)
        self.mid_r.set_recording(on)

    def _record_eviction(self, c: torch.Tensor, r: torch.Tensor) -> None:
        if not self.record_past:
            self.recorded_evictions = None
            return
        if self.recorded_evictions is None:
            self.recorded_evictions = (c.clone(), r.clone())
        else:
            self.recorded_evictions = (
                torch.cat([self.recorded_evictions[0], c], 1),
                torch.cat([self.recorded_evictions[1], r], 1),
            )

    def _mid_truncation_error(self, length: int) -> str | None:
        return self.mid_c.truncation_error(length) or self.mid_r.truncation_error(length)

    def _truncate_mid(self, length: int) -> None:
        self.mid_c.truncate(length)
        self.mid_r.truncate(length)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a count <= 0, as transformers >= 5.15 passes it), leaving
        the layer exactly as if they had never been appended: tokens they pushed out of the recent window come
        back unquantised. That needs the unquantised copies kept since past recording was activated or since the
        last ``crop`` (:meth:`activate_past_recording`); a crop reaching further back raises and changes
        nothing. Every crop, ``crop(0)`` included, starts a new recording span."""
        why = self.crop_error(tokens_to_remove)
        if why is not None:
            raise RuntimeError(why)
        if tokens_to_remove and self.is_initialized:
            self._rollback(self.seen + tokens_to_remove)
        self._checkpoint()

    def crop_error(self, tokens_to_remove: int) -> str | None:
        """Why ``crop(tokens_to_remove)`` could not be exact (``None``: it can); a bad argument raises ValueError."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(
                f"crop(tokens_to_remove={tokens_to_remove!r}): pass how many tokens to remove as a negative int "
                "(e.g. crop(-3)); 0 removes none"
            )
        if not tokens_to_remove or not self.is_initialized:
            return None
        n, n2 = self.seen, self.seen + tokens_to_remove
        if n2 < 0:
            raise ValueError(f"crop({tokens_to_remove}): cache layer {self.layer_idx} holds {n} tokens")
        need_from, need_to = self.restore_span(n2)
        end_mid = n - self.rec_c.shape[1]
        kept = 0 if self.recorded_evictions is None else self.recorded_evictions[0].shape[1]
        why = None
        if need_to > need_from and need_from < end_mid - kept:
            why = (f"tokens from position {need_from} left the recent window (quantised) before past recording "
                   f"started or before the last crop ({kept} evictions kept since)")  # fmt: skip
        why = why or self._mid_truncation_error(max(0, need_from - self.sink_c.length))
        if why is None:
            return None
        return (f"cannot crop cache layer {self.layer_idx} from {n} to {n2} tokens exactly: {why}; call "
                "cache.activate_past_recording() before appending the tokens to be removed (transformers' assisted "
                "decoding does), and crop at most the tokens appended since")  # fmt: skip

    def restore_span(self, n2: int) -> tuple[int, int]:
        """``[from, to)``: the positions of the middle that are unquantised again once the layer holds ``n2`` tokens
        (the windows' split of ``n2``); empty when ``to <= from``. ``from - sinks`` is the middle's new length."""
        _, r2 = self._split(n2)
        return n2 - r2, min(self.seen - self.rec_c.shape[1], n2)

    def _rollback(self, n2: int) -> None:
        """Bring the layer back to its first ``n2`` tokens (:meth:`crop_error` said it can)."""
        s, end_mid = self.sink_c.length, self.seen - self.rec_c.shape[1]
        s2 = min(s, n2)
        need_from, need_to = self.restore_span(n2)
        restore = max(0, need_to - need_from)
        back_c, back_r = self.rec_c[:, :0], self.rec_r[:, :0]
        if restore:
            kept = self.recorded_evictions[0].shape[1]
            start = need_from - (end_mid - kept)
            back_c = self.recorded_evictions[0][:, start : start + restore]
            back_r = self.recorded_evictions[1][:, start : start + restore]
        keep_rec = max(0, n2 - end_mid)
        self.rec_c = torch.cat([back_c, self.rec_c[:, :keep_rec]], 1)
        self.rec_r = torch.cat([back_r, self.rec_r[:, :keep_rec]], 1)
        self._truncate_mid(max(0, need_from - s2))
        if s2 < s:
            self.sink_c.truncate(s2)
            self.sink_r.truncate(s2)
        self.seen = n2

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for st in (self.sink_c, self.sink_r, self.mid_c, self.mid_r):
            st.map_batch(fn)
        self._map_windows(fn)
        self.batch = self.rec_c.shape[0]

    def _map_windows(self, fn) -> None:
        """The recent window's rows, and the evictions recorded for ``crop``, through ``fn`` (a batch map)."""
        self.rec_c, self.rec_r = fn(self.rec_c), fn(self.rec_r)
        if self.recorded_evictions is not None:
            self.recorded_evictions = (fn(self.recorded_evictions[0]), fn(self.recorded_evictions[1]))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of this layer's storage: windows and sinks as allocated, plus :meth:`_mid_nbytes`."""
        if not self.is_initialized:
            return 0
        hp = sum(t.numel() * t.element_size() for t in (self.rec_c, self.rec_r))
        return hp + self.sink_c.nbytes() + self.sink_r.nbytes() + self._mid_nbytes()


class QuantizedLatentCache(Cache):
    """A transformers ``Cache`` for MLA models that stores the latent packed in low-bit form.

    Args:
        config: the model's config (any supported MLA family).
        scheme: ``bf16``, ``fp8`` or ``c<b>r<b>`` (content / RoPE bits in {2,3,4,8}), e.g. ``c4r4``.
        group_size: channels per quantisation group (per token).
        sink / recent: the first ``sink`` and last ``recent`` tokens stay unquantised.
        page_size: quantised storage grows in pages of this many tokens (the kernel layout: 16, 32, 64
            or 128).
        hp_dtype: dtype of the unquantised windows (default: the model's activation dtype).
        backend: ``torch`` (dequantise, then attend), ``triton`` (the fused decode kernel; BF16
            models, schemes bf16 / c4r4 / c2r4), or ``auto``: triton for BF16 activations on CUDA
            when the kernel layout can hold the cache and the model reads the cache through quantmla's
            latent attention (:func:`quantmla.enable_latent_attention`, which calls
            :meth:`declare_latent_reader`), torch otherwise. A kernel decode step returns only the new token
            and attends itself, so transformers' own attention cannot read it: ``triton`` without a latent
            reader is an error. Each cache logs (INFO) once which
            backend it uses and why; ``backends_used()`` / ``backend_reasons()`` say it per layer.
        validate: check every stored token (finite, in the fp16 range of the scales). Off by default:
            only multi-token updates (prefill) are checked, so that decode steps make no GPU->CPU sync.
    """

    def __init__(
        self,
        config,
        scheme: str | CacheScheme = "c4r4",
        group_size: int = 64,
        sink: int = 4,
        recent: int = 128,
        page_size: int = 64,
        hp_dtype: torch.dtype | None = None,
        backend: str = "auto",
        validate: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; valid: {', '.join(BACKENDS)}")
        self.backend = backend
        adapter = get_adapter(config)
        dims: MLADims = adapter.dims(config)
        n_layers = adapter.num_cache_layers(config)
        self.codec = model_codec(scheme, n_layers)
        plain = self.codec.plain

        def layer_config(lc: LayerCodec) -> LatentCacheConfig:
            return LatentCacheConfig(
                scheme=lc.scheme,
                kv_lora_rank=dims.kv_lora_rank,
                rope_dim=dims.rope_dim,
                group_size=group_size,
                sink=sink,
                recent=recent,
                page_size=page_size,
                hp_dtype=hp_dtype,
                validate=validate,
                codec=lc if lc.fitted else None,
            )

        #: one config per layer (a per-layer codec: each layer its format and fitted parameters)
        self.layer_configs = [layer_config(lc) for lc in self.codec.layers]
        self.cache_config = self.layer_configs[0]
        if backend == "triton":
            from quantmla.cache.kernel_layer import kernel_layout

            if plain is None:
                raise ValueError(
                    f"backend='triton': codec {self.codec.name!r} has per-layer formats or fitted parameters, which "
                    "only the torch path holds; use backend='torch' or 'auto'"
                )
            kernel_layout(self.cache_config)  # fail now, with the reason, if the kernel cannot serve it
        layers = [QuantizedLatentLayer(c, i) for i, c in enumerate(self.layer_configs)]
        super().__init__(layers=layers)
        self._reasons: list[str | None] = [None] * len(layers)
        self._logged: set[str] = set()
        self._latent_reader = False

    def declare_latent_reader(self) -> None:
        """Say that the model attends this cache through quantmla's latent attention, which reaches a kernel
        decode step through :meth:`decode_backend`. Latent attention calls this before a module's update;
        without it the cache never decodes through the kernel (``auto``) or refuses to (``triton``)."""
        self._latent_reader = True

    def _choose_backend(self, key_states: torch.Tensor) -> tuple[str, str]:
        """``(backend, reason)`` for a layer whose first update is ``key_states``."""
        dev, dt = key_states.device.type, key_states.dtype
        where = f"{dev.upper() if dev == 'cuda' else dev}, {str(dt).removeprefix('torch.')}"
        if self.backend == "torch":
            return "torch", f"torch path: backend='torch' requested ({where})"
        if self.backend == "triton":
            if not self._latent_reader:
                raise ValueError(
                    "backend='triton': the model must attend through quantmla.enable_latent_attention(model); "
                    "under transformers' own attention a kernel decode step would attend only the newest token"
                )
            return "triton", f"triton kernel: backend='triton' requested ({where})"
        if dev != "cuda":
            return "torch", f"torch path: activations on {dev} (the kernel runs on CUDA)"
        if dt != torch.bfloat16:
            return "torch", f"torch path: activations in {where.split(', ')[1]} (the kernel needs bfloat16)"
        from quantmla.cache.kernel_layer import supports_kernel

        if self.codec.plain is None:
            why = f"codec {self.codec.name!r} has per-layer formats or fitted parameters"
            return "torch", f"torch path: {why} ({where})"
        ok, why = supports_kernel(self.cache_config)
        if not ok:
            return "torch", f"torch path: no kernel layout for this cache ({why})"
        if not self._latent_reader:
            return "torch", (f"torch path: the model does not read the cache through quantmla's latent attention "
                             f"(quantmla.enable_latent_attention), which the kernel needs ({where})")  # fmt: skip
        return "triton", f"triton kernel ({where})"

    def backends_used(self) -> list[str]:
        """Per layer, which path served it: ``torch``, or for the kernel path the kernel that read its pages at
        its last decode step (``triton``, or ``sm90``: :mod:`quantmla.kernels.hopper`); ``-`` before the first
        update."""
        from quantmla.cache.kernel_layer import KernelLatentLayer

        return [
            "-" if not lyr.is_initialized else (lyr.page_kernel if isinstance(lyr, KernelLatentLayer) else "torch")
            for lyr in self.layers
        ]

    def backend_reasons(self) -> list[str]:
        """Per layer, why its backend was chosen (the logged text; ``-`` before the first update)."""
        return [r or "-" for r in self._reasons]

    def decode_backend(self, layer_idx: int):
        """The :class:`~quantmla.cache.kernel_layer.KernelLatentLayer` of ``layer_idx`` when its last
        update was a single-token kernel decode step (it returned only the new token: attention must go
        through its ``attend``), else ``None`` (the update returned every cached token)."""
        from quantmla.cache.kernel_layer import KernelLatentLayer

        layer = self.layers[layer_idx]
        return layer if isinstance(layer, KernelLatentLayer) and layer.kernel_step else None

    @property
    def scheme(self) -> CacheScheme:
        """The scheme of every layer; a codec with per-layer formats or fitted parameters has none (see ``codec``)."""
        plain = self.codec.plain
        if plain is None:
            raise ValueError(f"codec {self.codec.name!r} has per-layer formats or fitted parameters: see cache.codec")
        return plain

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx={layer_idx} out of range: this cache has {len(self.layers)} layers")
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            backend, reason = self._choose_backend(key_states)
            self._reasons[layer_idx] = reason
            if reason not in self._logged:  # once per cache (again only if a layer decides otherwise)
                self._logged.add(reason)
                logger.info("quantmla cache %s: %s", self.codec.name, reason)
            if backend == "triton":
                from quantmla.cache.kernel_layer import KernelLatentLayer as cls
            else:
                cls = QuantizedLatentLayer
            if type(layer) is not cls:
                recording = layer.record_past
                layer = self.layers[layer_idx] = cls(self.layer_configs[layer_idx], layer_idx)
                layer.record_past = recording
        return layer.update(key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens from every layer, exactly (see
        :meth:`QuantizedLatentLayer.crop`); checked on every layer first, so a crop that cannot be exact raises
        and leaves the whole cache as it was."""
        for layer in self.layers:
            why = layer.crop_error(tokens_to_remove)
            if why is not None:
                raise RuntimeError(why)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes of the cache storage in use: unquantised windows and sinks as allocated, quantised
        tokens in whole pages (see each layer's ``nbytes``)."""
        return sum(layer.nbytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """:meth:`nbytes` per token per layer, averaged over the batch (measured, not a formula)."""
        seq = self.get_seq_length()
        layer0 = self.layers[0]
        if seq == 0 or not layer0.is_initialized:
            return 0.0
        return self.nbytes() / (len(self.layers) * seq * layer0.batch)
