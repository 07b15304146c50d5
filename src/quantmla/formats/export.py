"""The export format: ``quantmla.json`` next to the weights of a calibrated model directory.

One home for the file's name, version, the calibration method names and its reader and writer, so
that :mod:`quantmla.models.loading` (reads) and :mod:`quantmla.calibrate` (writes) share it without
importing each other. It depends on :mod:`quantmla.quant` only (a
method's per-layer codec is written beside the weights, in ``quantmla/codec.safetensors``: a folder of its own, since
vLLM loads every ``*.safetensors`` file of a model directory as weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.scheme import parse_scheme

META_FILE = "quantmla.json"
CODEC_FILE = "quantmla/codec.safetensors"
#: where exports of earlier versions kept the codec (read still; vLLM would load it as weights)
LEGACY_CODEC_FILE = "quantmla_codec.safetensors"
META_FORMAT = 1
METHODS = ("rtn", "smoothquant", "quarot", "quantmla", "raq", "blockgtq", "rolaq", "quantmla-raq", "raq-alloc")
_CODEC_FIELDS = ("transform", "clip_ratio", "gain")

# the keys every quantmla.json has, and their JSON types (bool is not an int here)
_REQUIRED = {"format": int, "scheme": str, "method": str, "group_size": int, "sink": int, "recent": int}


def validate_meta(meta, source: str) -> dict:
    """``meta`` checked as the content of a ``quantmla.json`` (``source`` names it in the errors)."""
    if not isinstance(meta, dict):
        raise ValueError(f"{source}: expected a JSON object with keys {list(_REQUIRED)}, got {type(meta).__name__}")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ValueError(f"{source}: missing keys {missing}; expected {list(_REQUIRED)}")
    for key, kind in _REQUIRED.items():
        v = meta[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ValueError(f"{source}: key {key!r} is {v!r} ({type(v).__name__}); expected a JSON {kind.__name__}")
    if meta["format"] != META_FORMAT:
        raise ValueError(f"{source}: format {meta['format']} is not supported (this quantmla reads {META_FORMAT})")
    try:
        parse_scheme(meta["scheme"])
    except ValueError as e:
        raise ValueError(f"{source}: key 'scheme': {e}") from None
    if meta["method"] not in METHODS:
        raise ValueError(f"{source}: key 'method' is {meta['method']!r}; valid: {', '.join(METHODS)}")
    if meta["group_size"] < 1:
        raise ValueError(f"{source}: key 'group_size' is {meta['group_size']}; must be >= 1")
    for key in ("sink", "recent"):
        if meta[key] < 0:
            raise ValueError(f"{source}: key {key!r} is {meta[key]}; must be >= 0")
    layer_schemes = meta.get("layer_schemes")
    if layer_schemes is not None:
        if not isinstance(layer_schemes, list) or not layer_schemes:
            raise ValueError(f"{source}: key 'layer_schemes' must be a non-empty list of scheme names")
        for i, name in enumerate(layer_schemes):
            try:
                parse_scheme(name)
            except ValueError as e:
                raise ValueError(f"{source}: layer_schemes[{i}]: {e}") from None
    return meta


def read_meta(path: str | Path) -> dict | None:
    """The validated ``quantmla.json`` of a model directory, ``None`` if it has none."""
    f = Path(path) / META_FILE
    if not f.exists():
        return None
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON ({e}); re-export the model with `quantmla calibrate`") from None
    return validate_meta(meta, str(f))


def write_meta(directory: str | Path, meta: dict) -> Path:
    """Validate ``meta`` and write it as ``directory/quantmla.json``; returns the file."""
    f = Path(directory) / META_FILE
    validate_meta(meta, str(f))
    f.write_text(json.dumps(meta, indent=2) + "\n")
    return f


def write_codec(directory: str | Path, codec: ModelCodec) -> tuple[Path, list[str]]:
    """Write the fitted tensors of ``codec`` as ``directory/quantmla/codec.safetensors``; returns the file and
    each layer's scheme name (for ``quantmla.json``'s ``layer_schemes``)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, lc in enumerate(codec.layers):
        for path in ("content", "rope"):
            pc = getattr(lc, path)
            for name in _CODEC_FIELDS:
                t = getattr(pc, name)
                if t is not None:
                    tensors[f"layers.{i}.{path}.{name}"] = t.detach().double().cpu().contiguous()
    f = Path(directory) / CODEC_FILE
    f.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(f))
    return f, [lc.scheme.name for lc in codec.layers]


def read_codec(directory: str | Path, meta: dict) -> ModelCodec | None:
    """The :class:`ModelCodec` of an export whose ``quantmla.json`` has ``layer_schemes`` (``None`` otherwise)."""
    names = meta.get("layer_schemes")
    if names is None:
        return None
    from safetensors.torch import load_file

    f = Path(directory) / CODEC_FILE
    if not f.exists() and (Path(directory) / LEGACY_CODEC_FILE).exists():
        f = Path(directory) / LEGACY_CODEC_FILE
    if not f.exists():
        raise ValueError(f"{Path(directory) / META_FILE} names per-layer schemes but {f} is missing; re-export")
    tensors = load_file(str(f))
    layers = []
    for i, name in enumerate(names):
        s = parse_scheme(name)
        paths = {}
        for path, fmt in (("content", s.content), ("rope", s.rope)):
            kw = {n: tensors.get(f"layers.{i}.{path}.{n}") for n in _CODEC_FIELDS}
            paths[path] = PathCodec(fmt, **kw)
        layers.append(LayerCodec(paths["content"], paths["rope"]))
    return ModelCodec(f"{meta['method']} {meta['scheme']}", tuple(layers))
