"""The package layers, read from the source: each package imports only the packages below it (function-level
imports included), peers on one layer not each other, no package cycle, no private name across modules; and the
vLLM entry point loads none of the calibration or modeling code."""

import ast
import subprocess
import sys
from pathlib import Path

import quantmla

SRC = Path(quantmla.__file__).parent

#: the declared order, bottom first; the packages of one layer are peers and import none of each other
LAYERS = [
    ("quant",),  # numerical quantisers
    ("formats",),  # schemes, codecs, packing, records, the window policy, the export's metadata
    ("models",),  # adapters of the MLA families, latent attention, loading
    ("kernels",),  # Triton and C++ decode, write and gather kernels
    ("cache",),  # QuantizedLatentCache
    ("transforms",),  # fusing transforms into the weights
    ("measure",),  # capture, attention replay, decode-cache simulation, token windows
    ("analysis", "eval", "calibrate", "convert"),
    ("serving",),  # paged decode, window shadows, the vLLM plugin
    ("cli",),
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
#: top-level modules above every layer: the lazy facade and ``python -m quantmla``
FACADE = {"__init__", "__main__"}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _package(module: str) -> str:
    """The layer package of ``quantmla.X...`` (``__init__``/``__main__`` for the root modules)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _imports(path: Path, module: str):
    """``(imported module, names)`` of every quantmla import in ``path``, relative imports resolved."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "quantmla" or a.name.startswith("quantmla."):
                    yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([name] if name else []))
            if name == "quantmla" or name.startswith("quantmla."):
                yield name, [a.name for a in node.names]


def test_every_package_is_declared():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in SRC.glob("*.py")}
    assert packages == set(LEVEL), f"undeclared: {sorted(packages - set(LEVEL))}, gone: {sorted(set(LEVEL) - packages)}"
    assert modules == FACADE, f"top-level modules outside a layer: {sorted(modules - FACADE)}"


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for module, path in _modules():
        pkg = _package(module)
        if pkg in FACADE:
            continue
        for target, names in _imports(path, module):
            dep = _package(target)
            if dep == pkg or (target == "quantmla" and names == ["__version__"]):  # the facade's constant
                continue
            if dep in FACADE or LEVEL[dep] >= LEVEL[pkg]:
                wrong.append(f"{module} ({pkg}, layer {LEVEL[pkg]}) imports {target} ({dep})")
    assert not wrong, "\n".join(wrong)


def test_no_package_cycle():
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        pkg = _package(module)
        for target, names in _imports(path, module):
            if _package(target) != pkg and names != ["__version__"]:
                graph.setdefault(pkg, set()).add(_package(target))
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError(f"package cycle: {' -> '.join([*trail, node])}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_no_private_name_is_imported_across_modules():
    crossing = []
    for module, path in _modules():
        for target, names in _imports(path, module):
            for name in names:
                if name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and target != module:
                    crossing.append(f"{module}: from {target} import {name}")
    assert not crossing, crossing


def _fresh_modules(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.split()


def test_the_vllm_entry_point_loads_no_calibration_and_no_modeling():
    """vLLM imports the plugin's entry point in every process; with the modules its ``register`` reads (the
    selection and the plugin's state) it must not load the calibration stack or transformers' models."""
    loaded = _fresh_modules(
        "import quantmla.serving.vllm, quantmla.serving.vllm.selection, quantmla.serving.vllm.plugin_state"
    )
    heavy = [m for m in loaded if m.startswith(("quantmla.calibrate", "quantmla.analysis", "quantmla.measure",
                                                "quantmla.cache", "quantmla.models", "quantmla.eval"))]  # fmt: skip
    modeling = [m for m in loaded if m.startswith("transformers") and ("modeling" in m or ".models." in m)]
    assert not heavy and not modeling, heavy + modeling
    assert "torch" not in _fresh_modules("import quantmla.serving.vllm")  # the entry point alone: not even torch


def test_the_root_package_loads_its_names_lazily():
    loaded = _fresh_modules("import quantmla")
    assert [m for m in loaded if m.startswith("quantmla.")] == [] and "torch" not in loaded
    loaded = _fresh_modules("import quantmla; quantmla.parse_scheme('c4r4')")
    assert "quantmla.formats.scheme" in loaded and "quantmla.calibrate" not in loaded
