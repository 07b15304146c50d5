"""The wheel holds only what the product runs: no prototype sources, and every module it ships is reached by
an import chain from an entry point (``import quantmla``, the ``quantmla`` command, the vLLM plugin)."""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: entry points: the facade, ``python -m quantmla``, the console script, the vLLM plugin
ENTRY = ("quantmla", "quantmla.__main__", "quantmla.cli.main", "quantmla.serving.vllm")
PROTOTYPE = re.compile(r"fragment|folded|kernel_v3|probe|prototype")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """``pip wheel . --no-deps`` of a clean copy of the tree (no stale build directory)."""
    src = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    (whl,) = out.glob("quantmla-*.whl")
    return zipfile.ZipFile(whl)


def test_no_prototype_in_the_wheel(wheel):
    names = [n for n in wheel.namelist() if not n.startswith("quantmla-")]
    assert names and all(n.startswith("quantmla/") for n in names), names[:5]
    assert not [n for n in names if PROTOTYPE.search(n)]
    from quantmla.kernels.hopper.build import HEADERS, SOURCES

    native = {n for n in names if n.endswith((".cu", ".cuh", ".h", ".cpp"))}  # only sources a build step compiles
    assert native == {"quantmla/kernels/cpu/paged_decode.cpp"} | {
        f"quantmla/kernels/hopper/csrc/{f}" for f in (*SOURCES, *HEADERS)
    }, native


def _module_of(name: str) -> str:
    parts = name.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _references(module: str, source: str, known: set[str]) -> set[str]:
    """Modules ``source`` imports (any depth, relative resolved) or names in a string (``"pkg.mod.Class"``:
    vLLM's registration by path), restricted to ``known``."""
    out: set[str] = set()
    is_pkg = module in {m for m in known if any(k.startswith(m + ".") for k in known)}
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("quantmla."):
            names = [node.value, node.value.rsplit(".", 1)[0]]
        for n in names:
            parts = n.split(".")
            out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known
    return out


def test_every_shipped_module_is_reached_from_an_entry_point(wheel):
    sources = {_module_of(n): wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".py")}
    known = set(sources)
    reached, todo = set(), [m for m in ENTRY if m in known]
    while todo:
        m = todo.pop()
        if m in reached:
            continue
        reached.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a module imports its packages
        todo += sorted(_references(m, sources[m], known) - reached)
    assert sorted(known - reached) == []
