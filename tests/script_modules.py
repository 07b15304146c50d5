"""The repository's scripts and benchmarks (not a package) as modules, for their tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """The module of ``ROOT / relative`` (e.g. ``"scripts/build_corpus.py"``), executed afresh."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
