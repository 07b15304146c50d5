"""Loading models, tokenizers and evaluation text from local sources (no network needed).

``MODEL`` may be a builtin name (``builtin:tiny-mla``), a local transformers directory, or a hub id
that is already in the local Hugging Face cache. Kimi-K2 directories (``model_type: kimi_k2``,
which AutoConfig rejects) are loaded through ``DeepseekV3Config``.

Everything that can be checked without the weights (device, dtype, path, ``quantmla.json``, config,
architecture) is checked by :func:`resolve_device`, :func:`resolve_dtype` and :func:`inspect_model`
before :func:`load` reads a single weight.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, PretrainedConfig

from quantmla.formats.codec import ModelCodec
from quantmla.formats.export import META_FILE, read_codec, read_meta
from quantmla.formats.scheme import parse_scheme
from quantmla.models.adapter import MLADims, get_adapter
from quantmla.models.fp8_checkpoint import Fp8Blocks, check_checkpoint, read_state_dict, write_dequantized
from quantmla.quant.affine import check_group

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "builtin:tiny-mla"
_BUILTINS = {"tiny-mla": "tiny-mla"}
#: builtins derived from a bundled one: name -> (base, kv_lora_rank, seed of the orthogonal embedding)
_DERIVED = {"tiny-mla-576": ("tiny-mla", 512, 0)}
BUILTIN_NAMES = (*_BUILTINS, *_DERIVED)
_CONFIG_OVERRIDES = {"kimi_k2": DeepseekV3Config}
#: model dtypes by name; ``auto`` is bfloat16 on CUDA and float32 on CPU (see :func:`resolve_dtype`)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ValueError`` if it is malformed or not present here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {str(device)!r} is not a device name; valid: cpu, cuda, cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {str(device)!r} is not supported; valid: cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested, but torch sees no CUDA device here; valid: cpu")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise ValueError(f"device {str(device)!r} does not exist; valid: cpu, cuda, cuda:0 .. cuda:{n - 1}")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The model dtype for ``dtype``: a ``torch.dtype``, a name in :data:`DTYPES`, or ``auto``: bfloat16 on
    CUDA (what models are served in), float32 on CPU (where bfloat16 matmuls are slow). ``auto`` is logged."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} not supported; valid: {', '.join(DTYPE_CHOICES)}")
        return dtype
    if dtype == "auto":
        chosen = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        logger.info("dtype=auto on %s: %s (auto is bfloat16 on CUDA, float32 on CPU)", device, dtype_name(chosen))
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; valid: {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def builtin_path(name: str) -> Path:
    """The directory of a builtin model; a derived one (:data:`_DERIVED`) is built on first use."""
    if name in _DERIVED:
        return _derived_path(name)
    if name not in _BUILTINS:
        raise ValueError(f"unknown builtin model {name!r}; valid: {', '.join('builtin:' + b for b in BUILTIN_NAMES)}")
    return Path(str(resources.files("quantmla") / "assets" / _BUILTINS[name]))


def _derived_path(name: str) -> Path:
    """``builtin:tiny-mla-576``: the bundled model with its latent embedded to 512 channels (exact, float32),
    written once under ``$QUANTMLA_CACHE`` (default ``~/.cache/quantmla``)."""
    import os
    import shutil
    import tempfile

    from quantmla.models.embed import embed_latent

    base, rank, seed = _DERIVED[name]
    root = Path(os.environ.get("QUANTMLA_CACHE", Path.home() / ".cache" / "quantmla")).expanduser()
    import hashlib

    src = builtin_path(base)
    digest = hashlib.sha256()
    for f in sorted(src.glob("*.safetensors")) + [src / "config.json"]:
        digest.update(f.read_bytes())
    # keyed by the base model's bytes: a new bundled model never reuses a derivation of the old one
    out = root / f"{name}-v2-{digest.hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building builtin:%s (builtin:%s, latent embedded to %d channels) in %s", name, base, rank, out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    wide = embed_latent(model, rank, seed=seed).to(torch.float32)
    wide.config.dtype = "float32"
    # an untied output layer (the same values): vLLM's DeepSeek models do not tie it to the embedding
    wide.config.tie_word_embeddings = False
    wide.lm_head.weight = torch.nn.Parameter(wide.get_input_embeddings().weight.detach().clone())
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
    wide.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, tmp / f)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(name_or_path: str | Path) -> Path:
    """The local directory behind ``name_or_path``, or a ``ValueError`` saying how to provide one."""
    s = str(name_or_path)
    if s.startswith("builtin:"):
        return builtin_path(s.split(":", 1)[1])
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} is a directory but holds no config.json: not a transformers model directory")
        return p
    if p.exists():
        raise ValueError(f"{p} is a file; MODEL must be a builtin name, a model directory or a hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    builtins = ", ".join("builtin:" + b for b in BUILTIN_NAMES)
    try:  # a hub id: only the local Hugging Face cache is consulted
        return Path(snapshot_download(s, local_files_only=True))
    except HFValidationError:
        raise ValueError(
            f"model {s!r} is neither a builtin ({builtins}), a local directory, nor a valid hub id (namespace/name)"
        ) from None
    except (LocalEntryNotFoundError, RepositoryNotFoundError, OSError) as e:  # not available offline
        raise ValueError(
            f"model {s!r} is neither a builtin ({builtins}), a local directory, "
            f"nor in the local Hugging Face cache, and quantmla never downloads. Fetch it on a machine with network "
            f"(e.g. `huggingface-cli download {s} --local-dir DIR`), copy DIR here and pass its path. "
            f"({type(e).__name__})"
        ) from None


def load_config(path: Path):
    raw = json.loads((path / "config.json").read_text())
    override = _CONFIG_OVERRIDES.get(raw.get("model_type"))
    if override is not None:
        raw = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
        return override(**raw)
    return AutoConfig.from_pretrained(path)


@dataclass(frozen=True)
class ModelSource:
    """A model directory checked without its weights: path, validated ``quantmla.json``, config."""

    path: Path
    config: PretrainedConfig
    meta: dict | None  # the directory's quantmla.json, validated (None: it has none)
    codec: ModelCodec | None = None  # a codec method's per-layer codec (raq, blockgtq), read with the metadata
    #: an FP8 block-quantised checkpoint's blocks (its headers checked), read by quantmla (None: unquantised)
    fp8: Fp8Blocks | None = None

    @property
    def dims(self) -> MLADims:
        return get_adapter(self.config).dims(self.config)

    @property
    def num_cache_layers(self) -> int:
        return get_adapter(self.config).num_cache_layers(self.config)


def inspect_model(name_or_path: str | Path | ModelSource) -> ModelSource:
    """Resolve ``name_or_path`` and check everything but the weights: ``quantmla.json`` (its keys and that
    its scheme and group size fit this model), ``config.json`` and that the architecture is a supported MLA."""
    if isinstance(name_or_path, ModelSource):
        return name_or_path
    path = resolve_model_path(name_or_path)
    meta = read_meta(path)  # a corrupt quantmla.json fails before any weight is loaded
    config = load_config(path)
    adapter = get_adapter(config)  # fail early, with the list of supported architectures
    fp8 = Fp8Blocks.of(config)
    if fp8 is not None:
        check_checkpoint(path, fp8)  # shards, scales and their grids, from the headers
    if meta is not None:
        dims = adapter.dims(config)
        scheme = parse_scheme(meta["scheme"])
        for fmt, dim in ((scheme.content, dims.kv_lora_rank), (scheme.rope, dims.rope_dim)):
            if fmt.kind == "int":
                try:
                    check_group(dim, meta["group_size"])
                except ValueError as e:
                    raise ValueError(f"{path / META_FILE}: key 'group_size': {e}") from None
    codec = None if meta is None else read_codec(path, meta)
    if codec is not None:
        dims = adapter.dims(config)
        try:
            codec.check(adapter.num_cache_layers(config), dims.kv_lora_rank, dims.rope_dim, meta["group_size"])
        except ValueError as e:
            raise ValueError(f"{path / META_FILE}: per-layer codec: {e}") from None
    return ModelSource(path, config, meta, codec, fp8)


#: ``device_map`` values :func:`load_model` takes (accelerate's placement: the GPUs, then the host, then disk)
DEVICE_MAPS = ("auto",)


@dataclass(frozen=True)
class Placement:
    """Where a model's weights go: one ``device``, or accelerate's ``device_map`` (``auto``) within ``max_memory``
    (``{"cpu": "20GiB", 0: "70GiB"}``; what does not fit goes to disk, in ``offload_folder``)."""

    device: str = "cpu"
    device_map: str | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        if self.device_map is None:
            if self.max_memory is not None:
                raise ValueError("max_memory applies to device_map='auto'")
            resolve_device(self.device)
            return
        if self.device_map not in DEVICE_MAPS:
            raise ValueError(f"device_map={self.device_map!r}; valid: {', '.join(DEVICE_MAPS)}")
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise ValueError("device_map='auto' needs accelerate: pip install 'quantmla[eval]'") from None
        for key, size in (self.max_memory or {}).items():
            n = torch.cuda.device_count()
            if key not in ("cpu", "disk") and not (isinstance(key, int) and 0 <= key < n):
                valid = ", ".join(["cpu", "disk", *map(str, range(n))])
                raise ValueError(f"max_memory key {key!r}; valid: {valid}")
            _size_bytes(size)

    @property
    def compute_device(self) -> torch.device:
        """The device the dtype is chosen for: the first GPU of a device map if there is one."""
        if self.device_map is None:
            return resolve_device(self.device)
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def parse_max_memory(text: str | None) -> dict | None:
    """``"0=70GiB,cpu=200GiB"`` -> ``{0: "70GiB", "cpu": "200GiB"}`` (GPU indices as ints)."""
    if not text:
        return None
    out: dict = {}
    for part in text.split(","):
        key, sep, size = part.strip().partition("=")
        if not sep or not size:
            raise ValueError(f"--max-memory entry {part!r}: DEVICE=SIZE, e.g. 0=70GiB,cpu=200GiB")
        out[int(key) if key.isdigit() else key] = size
    return out


def _size_bytes(size) -> int:
    from accelerate.utils import convert_file_size_to_int

    try:
        return convert_file_size_to_int(size)
    except ValueError:
        raise ValueError(f"max_memory size {size!r}: a number of bytes or e.g. 200MiB, 70GiB") from None


def load(
    name_or_path: str | Path | ModelSource = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    placement: Placement | None = None,
):
    """Load ``(model, tokenizer)`` in eval mode; the model must be a supported MLA architecture.

    ``dtype``: ``auto`` (the default) is bfloat16 on CUDA and **float32 on CPU**; or ``bfloat16``,
    ``float32``, ``float64`` (name or ``torch.dtype``). The dtype chosen is logged. Device, dtype,
    path, config and ``quantmla.json`` are all checked before any weight is read.

    A directory written by ``quantmla calibrate`` carries ``quantmla.json``; it is validated and kept
    as ``model.quantmla_meta`` (``None`` otherwise), and quantmla commands use its cache scheme. An FP8
    block-quantised checkpoint (DeepSeek-V3's format) is dequantised to ``dtype`` by quantmla
    (:mod:`quantmla.models.fp8_checkpoint`).
    """
    src = inspect_model(name_or_path)
    model = load_model(src, dtype, device, attn_implementation, placement)
    return model, load_tokenizer(src)


def load_model(
    name_or_path: str | Path | ModelSource = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    placement: Placement | None = None,
):
    """The model of :func:`load` alone (no tokenizer). ``placement``: accelerate's device map instead of
    ``device`` (a model larger than one device: its layers spread over the GPUs, the host and disk)."""
    if placement is not None and placement.device_map is not None:
        return _load_mapped(inspect_model(name_or_path), dtype, attn_implementation, placement)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    src = inspect_model(name_or_path)
    logger.info("loading %s in %s on %s", src.path, dtype_name(torch_dtype), dev)
    model = _from_pretrained(src, dtype=torch_dtype, attn_implementation=attn_implementation).to(dev)
    model.quantmla_meta = src.meta  # the exported cache scheme, if the directory has one
    return model.eval()


def _from_pretrained(src: ModelSource, **kw):
    """The model class's own loader on ``src`` (``kw``: ``dtype`` and its other arguments); an FP8 block-quantised
    checkpoint is dequantised to ``dtype`` by quantmla first and handed over as a state dict."""
    if src.fp8 is None:
        return AutoModelForCausalLM.from_pretrained(src.path, config=src.config, **kw)
    logger.info("%s: FP8 blocks of %s dequantised to %s by quantmla", src.path, list(src.fp8.block),
                dtype_name(kw["dtype"]))  # fmt: skip
    cls, config = _dequantised_class(src)
    state = read_state_dict(src.path, src.fp8, kw["dtype"])
    return cls.from_pretrained(None, config=config, state_dict=state, **kw)


def _dequantised_class(src: ModelSource):
    """``(model class, config without its quantization_config)`` of an FP8 checkpoint that quantmla dequantises."""
    import copy

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = copy.deepcopy(src.config)
    del config.quantization_config
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config


def _load_mapped(src: ModelSource, dtype, attn_implementation: str, placement: Placement):
    """``src`` placed by accelerate's device map. An FP8 checkpoint is first dequantised one tensor at a time into
    shards in the offload folder (``dequantized/``: the model's size in ``dtype`` on disk, one shard in host memory),
    which the loader then places lazily like any checkpoint."""
    import tempfile
    from collections import Counter

    torch_dtype = resolve_dtype(dtype, placement.compute_device)
    offload = placement.offload_folder or tempfile.mkdtemp(prefix="quantmla-offload-")
    kw = dict(dtype=torch_dtype, attn_implementation=attn_implementation, device_map=placement.device_map,
              max_memory=placement.max_memory, offload_folder=offload)  # fmt: skip
    if src.fp8 is None:
        model = _from_pretrained(src, **kw)
    else:
        plain = write_dequantized(src.path, src.fp8, torch_dtype, Path(offload) / "dequantized")
        logger.info("%s: FP8 blocks of %s dequantised to %s shards in %s", src.path, list(src.fp8.block),
                    dtype_name(torch_dtype), plain)  # fmt: skip
        cls, config = _dequantised_class(src)
        config.save_pretrained(plain)
        if (src.path / "generation_config.json").is_file():
            shutil.copy2(src.path / "generation_config.json", plain / "generation_config.json")
        model = cls.from_pretrained(plain, config=config, **kw)
    where = Counter(str(v) for v in getattr(model, "hf_device_map", {}).values())
    logger.info("loaded %s in %s with device_map=%s: modules on %s (offload folder %s)", src.path,
                dtype_name(torch_dtype), placement.device_map, dict(where), offload)  # fmt: skip
    model.quantmla_meta = src.meta
    return model.eval()


def load_tokenizer(name_or_path: str | Path | ModelSource = DEFAULT_MODEL):
    """The model directory's tokenizer alone (no weights read): a ``ValueError`` if it has none usable."""
    src = inspect_model(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(src.path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{src.path} holds no usable tokenizer ({type(e).__name__}: {e})") from None


def builtin_text(split: str = "test") -> str:
    """The bundled corpus split (``validation`` or ``test``) the default model was evaluated on."""
    if split not in ("validation", "test"):
        raise ValueError(f"split={split!r}; the bundled text has 'validation' and 'test'")
    return (builtin_path("tiny-mla") / "data" / f"{split}.txt").read_text("utf-8")


def load_text(
    text_file: str | Path | None = None, dataset: str | Path | None = None, split: str = "test", column: str = "text"
) -> str:
    """Evaluation text: a local file, a ``datasets`` dataset saved with ``save_to_disk``, or the bundled split."""
    if text_file is not None and dataset is not None:
        raise ValueError("give either a text file or a dataset directory, not both")
    if text_file is not None:
        p = Path(text_file)
        if not p.is_file():
            raise ValueError(f"text file {p} does not exist")
        return p.read_text("utf-8")
    if dataset is not None:
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ValueError(
                "reading a saved dataset needs the 'datasets' package: pip install 'quantmla[eval]'"
            ) from None
        ds = load_from_disk(str(dataset))
        if hasattr(ds, "keys"):  # a DatasetDict
            if split not in ds:
                raise ValueError(f"dataset {dataset} has splits {list(ds.keys())}, not {split!r}")
            ds = ds[split]
        if column not in ds.column_names:
            raise ValueError(f"dataset {dataset} has columns {ds.column_names}, not {column!r}")
        return "\n\n".join(t for t in ds[column] if t)
    return builtin_text(split)
