"""The export format: ``quantmla.json`` next to the weights of a calibrated model directory.

One home for the file's name, version, the calibration method names and its reader and writer, so
that :mod:`quantmla.models.loading` (reads) and :mod:`quantmla.calibrate` (writes) share it without
importing each other. It depends on :mod:`quantmla.quant.scheme` only.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantmla.quant.scheme import parse_scheme

META_FILE = "quantmla.json"
META_FORMAT = 1
METHODS = ("rtn", "smoothquant", "quarot", "quantmla")

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
