"""Public names do not shadow modules, and no private name crosses a package (issue 15, item 9 and structure)."""

import ast
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


def _imports(path: Path):
    mod = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quantmla"):
            yield mod, node.module, [a.name for a in node.names]


def _package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (SRC / parts[-1]).is_dir() else parts[0]


def test_no_private_name_crosses_a_package():
    crossing = []
    for path in SRC.rglob("*.py"):
        for mod, src_mod, names in _imports(path):
            for name in names:
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                if private and _package_of(mod) != _package_of(src_mod):
                    crossing.append(f"{mod}: from {src_mod} import {name}")
    assert not crossing, crossing


def test_the_export_format_depends_on_neither_models_nor_calibrate():
    for path in [SRC / "export_format.py", *(SRC / "models").rglob("*.py")]:
        for mod, src_mod, _ in _imports(path):
            assert not src_mod.startswith("quantmla.calibrate"), (mod, src_mod)
    deps = {src_mod for _, src_mod, _ in _imports(SRC / "export_format.py")}
    assert deps <= {"quantmla.quant.scheme", "quantmla.quant.codec"}, deps
