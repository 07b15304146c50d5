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

import os
from dataclasses import dataclass
from pathlib import Path

from quantmla.formats.export import META_FILE, read_meta

ENV_SCHEME, ENV_GROUP, ENV_WINDOWS = "QUANTMLA_SCHEME", "QUANTMLA_GROUP_SIZE", "QUANTMLA_WINDOWS"
#: the schemes the plugin serves (records of :class:`~quantmla.formats.records.RecordLayout`, tested end to end)
SERVED_SCHEMES = ("bf16", "fp8", "c8r8", "c4r4", "c2r4")
#: (sink, recent) unless a source says otherwise: QuantizedLatentCache's defaults
DEFAULT_WINDOWS = (4, 128)


@dataclass(frozen=True)
class Selection:
    scheme: str
    group_size: int
    source: str  # where it came from, for the log line
    windows: tuple[int, int] | None = None  # (sink, recent) if this source gives them

    def __post_init__(self) -> None:
        if self.windows is not None and (len(self.windows) != 2 or min(self.windows) < 0):
            raise ValueError(f"quantmla windows {self.windows} ({self.source}): give [sink, recent], each >= 0")
        if self.scheme not in SERVED_SCHEMES:
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
    given = [f for f in found if f.windows is not None]
    for other in given[1:]:
        if other.windows != given[0].windows:
            raise ValueError(
                f"quantmla: {given[0].source} asks for windows {list(given[0].windows)} but {other.source} for"
                f" {list(other.windows)}; give one, or make them agree"
            )
    windows = given[0].windows if given else DEFAULT_WINDOWS
    return Selection(first.scheme, first.group_size, first.source, windows)
