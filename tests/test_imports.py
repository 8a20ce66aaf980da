"""The core's import graph: no circle among specdec's modules, and no import of a plugin package.

Every `import` and `from ... import` statement counts, wherever it sits (module level, inside a function, or
under `if TYPE_CHECKING:`): a lazy import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

import specdec

SRC = Path(specdec.__file__).resolve().parent.parent
NOT_PLUGINS = ("specdec", "specdec_kernels")  # the core and its kernels package


def _plugin_packages() -> set[str]:
    """Top-level packages of every installed `specdec` entry point (this project's own among them)."""
    values = [ep.value for ep in importlib.metadata.entry_points(group="specdec")]
    return {value.split(":")[0].split(".")[0] for value in values} - set(NOT_PLUGINS)


PLUGIN_PACKAGES = _plugin_packages()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _core_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "specdec").rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `name` imports: for `from X import y`, X.y when that is a module, else X; the string given to
    importlib.import_module or __import__; and the packages of what it imports from outside its own package
    (importing a.b.c first runs a.b's __init__), up to but not including the top `specdec` package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                found.add(node.args[0].value)
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    for module in list(found):
        parent = module.rpartition(".")[0]
        while "." in parent and not (package + ".").startswith(parent + "."):
            found.add(parent)
            parent = parent.rpartition(".")[0]
    return found


def _is_plugin(module: str) -> bool:
    top = module.split(".")[0]  # an entry point's package, or any later specdec_* plugin not installed here
    return top in PLUGIN_PACKAGES or (top.startswith("specdec_") and top not in NOT_PLUGINS)


def import_graph() -> dict[str, set[str]]:
    modules = _core_modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle among the graph's own nodes (edges to outside modules ignored), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_core_imports_no_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_core_imports_no_plugin():
    offenders = {name: sorted(m for m in imported if _is_plugin(m))
                 for name, imported in import_graph().items()}
    offenders = {name: mods for name, mods in offenders.items() if mods}
    assert not offenders, f"the core imports plugins: {offenders}"


def test_the_checks_can_fail():
    # the walker sees lazy, relative and TYPE_CHECKING imports, and the search finds a planted circle
    graph = import_graph()
    assert "specdec.contracts" in graph and "specdec.target" in graph
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "os"}, "b": set()}) is None
    assert {"specdec_dflash", "specdec_eagle"} <= PLUGIN_PACKAGES
    assert _is_plugin("specdec_dflash.export") and _is_plugin("specdec_dflash2")
    assert not _is_plugin("specdec_kernels") and not _is_plugin("specdec.native")


@pytest.mark.parametrize("source, expected", [
    ("from . import tree\n", "specdec.tree"),
    ("from .contracts import Draft\n", "specdec.contracts"),
    ("def f():\n    from .plugins import get_registry\n", "specdec.plugins"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .target import TargetModel\n",
     "specdec.target"),
    ("import importlib\nimportlib.import_module('specdec_dflash.export')\n", "specdec_dflash.export"),
    ("__import__('specdec.cli')\n", "specdec.cli"),
])
def test_every_kind_of_import_is_seen(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert expected in _imports("specdec.probe", path, _core_modules())


def test_importing_a_submodule_runs_its_package(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from .bench.plan import plan_bench\n")
    assert {"specdec.bench.plan", "specdec.bench"} <= _imports("specdec.probe", path, _core_modules())
    inside = _imports("specdec.bench.report", _core_modules()["specdec.bench.report"], _core_modules())
    assert "specdec.bench" not in inside  # a package's own modules do not run its __init__ again
