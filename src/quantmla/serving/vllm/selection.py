"""Which cache scheme the vLLM plugin serves, from what the user asked for (no vLLM import here).

Sources, any of which switches the plugin on:

* vLLM's ``additional_config={"quantmla": {"scheme": "c4r4", "group_size": 64}}``
  (``--additional-config '{"quantmla": {...}}'`` on ``vllm serve``);
* the environment variable ``QUANTMLA_SCHEME`` (and ``QUANTMLA_GROUP_SIZE``);
* the model directory's ``quantmla.json``, written by ``quantmla calibrate``.

Sources that are given must agree; none given: the plugin stays off and vLLM runs unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from quantmla.export_format import META_FILE, read_meta
from quantmla.serving.records import RECORD_SCHEMES

ENV_SCHEME, ENV_GROUP = "QUANTMLA_SCHEME", "QUANTMLA_GROUP_SIZE"
#: the position policy inside the engine: every token is read as stored (see the README, "Serve with vLLM")
SINK, RECENT = 0, 0


@dataclass(frozen=True)
class Selection:
    scheme: str
    group_size: int
    source: str  # where it came from, for the log line
    windows: tuple[int, int] | None = None  # (sink, recent) an export was calibrated for

    def __post_init__(self) -> None:
        if self.scheme not in RECORD_SCHEMES:
            raise ValueError(f"quantmla scheme {self.scheme!r} ({self.source}); valid: {', '.join(RECORD_SCHEMES)}")
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
        bad = sorted(set(extra) - {"scheme", "group_size"})
        if bad:
            raise ValueError(f"additional_config['quantmla']: unknown keys {bad}; valid: scheme, group_size")
        found.append(Selection(str(extra["scheme"]).lower(), int(extra.get("group_size", 64)), "additional_config"))
    if environ.get(ENV_SCHEME):
        group = environ.get(ENV_GROUP, "64")
        if not group.isdigit():
            raise ValueError(f"{ENV_GROUP}={group!r} is not an integer; valid: 16, 32, 64, 128")
        found.append(Selection(environ[ENV_SCHEME].lower(), int(group), ENV_SCHEME))
    if model_path and Path(model_path).is_dir() and (Path(model_path) / META_FILE).is_file():
        meta = read_meta(Path(model_path))
        where = str(Path(model_path) / META_FILE)
        found.append(Selection(meta["scheme"], int(meta["group_size"]), where, (meta["sink"], meta["recent"])))
    if not found:
        return None
    first = found[0]
    for other in found[1:]:
        if (other.scheme, other.group_size) != (first.scheme, first.group_size):
            raise ValueError(
                f"quantmla: {first.source} asks for {first.scheme}/g{first.group_size} but {other.source} for"
                f" {other.scheme}/g{other.group_size}; give one, or make them agree"
            )
    windows = next((f.windows for f in found if f.windows is not None), None)
    return Selection(first.scheme, first.group_size, first.source, windows)
