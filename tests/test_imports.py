"""The core's import graph: no circle among specdec's modules, and no import of a plugin package.

Every `import` and `from ... import` statement counts, wherever it sits (module level, inside a function, or
under `if TYPE_CHECKING:`): a lazy import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specdec

SRC = Path(specdec.__file__).resolve().parent.parent
PLUGIN_PACKAGES = ("specdec_dflash", "specdec_eagle")  # and any later plugin: see _is_plugin
NOT_PLUGINS = ("specdec", "specdec_kernels")  # the core and its kernels package


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _core_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "specdec").rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `name` imports: for `from X import y`, X.y when that is a module, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    return found


def _is_plugin(module: str) -> bool:
    top = module.split(".")[0]
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
    assert _is_plugin("specdec_dflash.export") and _is_plugin("specdec_dflash2")
    assert not _is_plugin("specdec_kernels") and not _is_plugin("specdec.native")


@pytest.mark.parametrize("source, expected", [
    ("from . import tree\n", "specdec.tree"),
    ("from .contracts import Draft\n", "specdec.contracts"),
    ("def f():\n    from .plugins import get_registry\n", "specdec.plugins"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .target import TargetModel\n",
     "specdec.target"),
])
def test_every_kind_of_import_is_seen(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert expected in _imports("specdec.probe", path, _core_modules())
