"""strata's modules import one another without cycles: every import counts, a lazy one inside a function too (the
cycle is there all the same, it only fails later), and so do imports for type checking alone."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import strata

ROOT = Path(strata.__file__).parent


def module_graph() -> dict[str, set[str]]:
    """module -> the strata modules it imports (a package's own submodules and the package itself left out)."""
    files = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in ROOT.rglob("*.py")}

    def module_of(name: str) -> str | None:  # `strata.a.b.Name` -> the module `strata.a.b`
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("strata"):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("strata")]
            else:
                continue
            for target in filter(None, map(module_of, names)):
                if target not in (mod, "strata") and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_strata_has_no_import_cycles():
    graph = module_graph()
    assert "strata.runtime.model.transformer" in graph  # the scan found the package
    assert cycles(graph) == []
