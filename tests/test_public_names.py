"""Public names do not shadow modules, and the root package exposes its names lazily."""

import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import quantmla

SRC = Path(quantmla.__file__).parent


def test_import_calibrate_api_in_a_fresh_interpreter():
    code = "import quantmla, quantmla.calibrate.api, types; assert isinstance(quantmla.calibrate, types.ModuleType)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert isinstance(quantmla.calibrate, types.ModuleType)
    assert callable(quantmla.calibrate_model) and callable(quantmla.export)


PACKAGES = ["quantmla", *(m.name for m in pkgutil.walk_packages(quantmla.__path__, "quantmla.") if m.ispkg)]


@pytest.mark.parametrize("name", PACKAGES)
def test_no_public_name_is_also_a_submodule(name):
    pkg = importlib.import_module(name)
    subs = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    names = set(getattr(pkg, "__all__", ())) | {n for n in vars(pkg) if not n.startswith("_")}
    clashes = [f"{name}.{n}" for n in sorted(names & subs) if not isinstance(getattr(pkg, n), types.ModuleType)]
    assert not clashes, clashes
