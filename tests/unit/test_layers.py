"""The shape of the code: packages import one another without cycles, no module is
over 500 lines, and autopar's top level holds few modules (issue "One house").

The import check is independent of import-linter's contract (``pyproject.toml``, run
by ``.ci/run``): it reads the source with ``ast`` (every import, also those inside
functions) and folds modules into their packages, so a cycle import-linter's layers
could miss (a package left out of the contract) still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
           "autopar.cost_models": ROOT / "cost_models"}
MAX_LINES = 500
MAX_TOP_LEVEL = 8


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module autopar installs."""
    out = {}
    for prefix, base in SOURCES.items():
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The autopar modules ``name`` imports, wherever the import statement stands."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def package_of(name: str) -> str:
    """The unit the check folds ``name`` into: ``autopar.<package>`` for a module of a
    package, the module itself for a top-level module."""
    return ".".join(name.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        src = package_of(name)
        for dst in imports(name, path, set(mods)):
            if package_of(dst) != src and dst != "autopar":
                graph.setdefault(src, set()).add(package_of(dst))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

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


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    assert "autopar.search" in graph and "autopar.module" in graph  # the check sees them
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    # the check itself: a graph with a cycle is reported
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_500_lines() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_few_modules_at_autopar_top_level() -> None:
    top = sorted(p.name for p in (ROOT / "autopar").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
