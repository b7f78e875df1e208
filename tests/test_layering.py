"""The package's layers: no import cycles (function-level imports included), every module imports
on its own, the engine imports nothing from the cleanup, the rewrites or the outlining, and the IR
toolkit nothing from the layers built on it."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    """Every module of the package, by its import name (the folders pyproject.toml maps)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: ROOT / config.get("package-dir", {}).get(package, package.replace(".", "/"))
               for package in config["packages"]}
    found = {}
    for package, folder in folders.items():
        for path in folder.glob("*.py"):
            found[package if path.name == "__init__.py" else f"{package}.{path.stem}"] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_cycles_are_found():  # the check itself: a planted cycle is reported
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_imports_no_cleanup():
    known = modules()
    engine = imports("onnx_autodiff.passes.autodiff", known["onnx_autodiff.passes.autodiff"], known)
    assert not engine & {"onnx_autodiff.passes.cleanup", "onnx_autodiff.passes.rewrites", "onnx_autodiff.passes.outline"}


def test_the_toolkit_imports_no_layer_above_it():
    """Beside the errors, the toolkit reads only the model-file edge (modelfile converts to and
    from protobuf), which itself builds on nothing but the errors and file writing."""
    known = modules()
    toolkit = {name for name in known if name.startswith("onnx_autodiff.toolkit")}
    used = set().union(*(imports(name, known[name], known) for name in toolkit))
    base = {"onnx_autodiff.errors", "onnx_autodiff.files", "onnx_autodiff.modelfile"}
    assert toolkit and used <= toolkit | base, sorted(used - toolkit)
    edge = imports("onnx_autodiff.modelfile", known["onnx_autodiff.modelfile"], known)
    assert edge <= {"onnx_autodiff.errors", "onnx_autodiff.files"}, sorted(edge)


def test_every_module_imports_first():
    """Each module imported first in a fresh set of the package's modules: a cycle through a
    package's __init__ (which the static check does not follow) fails here."""
    names = sorted(name for name in modules() if not name.endswith(".__main__"))  # that one runs the CLI
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'onnx_autodiff' or m.startswith('onnx_autodiff.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_toolkit_alone_defines_the_shared_readers_and_zeros():
    """constant(), number(), axes() and zeros() have one home: a function of one of those names
    (nested ones included) anywhere else in the package is a copy that drifts."""
    from onnx_autodiff import toolkit

    shared = {"constant", "number", "axes", "zeros"}
    assert all(callable(getattr(toolkit, name)) for name in shared)
    copies = sorted(
        f"{name}.{node.name}"
        for name, path in modules().items() if not name.startswith("onnx_autodiff.toolkit")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in shared
    )
    assert copies == []
