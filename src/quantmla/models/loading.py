"""Loading models, tokenizers and evaluation text from local sources (no network needed).

``MODEL`` may be a builtin name (``builtin:tiny-mla``), a local transformers directory, or a hub id
that is already in the local Hugging Face cache. Kimi-K2 directories (``model_type: kimi_k2``,
which AutoConfig rejects) are loaded through ``DeepseekV3Config``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config

from quantmla.export_format import read_meta
from quantmla.models.adapter import get_adapter

DEFAULT_MODEL = "builtin:tiny-mla"
_BUILTINS = {"tiny-mla": "tiny-mla"}
_CONFIG_OVERRIDES = {"kimi_k2": DeepseekV3Config}


def builtin_path(name: str) -> Path:
    if name not in _BUILTINS:
        raise ValueError(f"unknown builtin model {name!r}; valid: {', '.join('builtin:' + b for b in _BUILTINS)}")
    return Path(str(resources.files("quantmla") / "assets" / _BUILTINS[name]))


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
    try:  # a hub id: only the local Hugging Face cache is consulted
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(s, local_files_only=True))
    except Exception as e:  # noqa: BLE001  (any hub failure means: not available offline)
        raise ValueError(
            f"model {s!r} is neither a builtin ({', '.join('builtin:' + b for b in _BUILTINS)}), a local directory, "
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


def load(
    name_or_path: str | Path = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """Load ``(model, tokenizer)`` in eval mode; the model must be a supported MLA architecture.

    A directory written by ``quantmla calibrate`` carries ``quantmla.json``; it is validated and kept
    as ``model.quantmla_meta`` (``None`` otherwise), and quantmla commands use its cache scheme.
    """
    path = resolve_model_path(name_or_path)
    read_meta(path)  # a corrupt or mismatched quantmla.json fails before any weight is loaded
    config = load_config(path)
    get_adapter(config)  # fail early, with the list of supported architectures
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation
    ).to(device)
    model.quantmla_meta = read_meta(path)  # the exported cache scheme, if the directory has one
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} holds no usable tokenizer ({type(e).__name__}: {e})") from None
    return model.eval(), tokenizer


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
