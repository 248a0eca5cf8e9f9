"""specedge's modules import each other without a cycle, lazy (function-level) imports included, and the runtime
never imports the export side."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # torch-free: make test-fast
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"runtime": "specedge.runtime", "export": "specedge.export"}  # folder -> package (pyproject package-dir)


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a module, or a module's attribute) lives in, or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (_owner(a.name, modules) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for a in node.names:  # `from . import schema` imports the submodule, not the package's body
                    dep = _owner(f"{base}.{a.name}", modules)
                    if dep == base or dep is None:
                        dep = _owner(base, modules)
                    if dep is not None:
                        deps.add(dep)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40  # every module was read
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(f"{m} (imports {sorted(graph[m] & set(c))})" for m in c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_runtime_never_imports_export():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.startswith("specedge.export")) for m, deps in graph.items()
           if m.startswith("specedge.runtime")}
    assert not {m: d for m, d in bad.items() if d}


def test_only_the_ray_deployment_imports_ray():
    """ray is an optional extra: the rest of the package runs without it."""
    importers = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "ray" or n.startswith("ray.") for n in names):
                importers.add(name)
    assert importers == {"specedge.runtime.serve_ray"}, importers
