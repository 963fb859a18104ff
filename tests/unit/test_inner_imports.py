"""Imports stand at the top of their module; one inside a function says why on its own
line or the line above: ``# cycle: <module> imports this one``, ``# start-up: <package>
costs ~N s to import`` or ``# optional: <why the package may be missing>``.

List them with their reasons (``file:line  module  reason``, then the count):
``python tests/unit/test_inner_imports.py``.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("autopar", "passes", "cost_models")
REASON = re.compile(r"#\s*((?:cycle|start-up|optional):.*)$")


@dataclass(frozen=True)
class InnerImport:
    """One import statement inside a function, and the reason its comment gives."""

    file: str
    line: int
    module: str
    reason: str | None


def _module(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.Import):
        return ", ".join(a.name for a in node.names)
    return "." * node.level + (node.module or "")


def _reason(lines: list[str], lineno: int) -> str | None:
    """The reason on the import's first line, else on a comment line just above it."""
    m = REASON.search(lines[lineno - 1])
    if m is None and lineno >= 2 and lines[lineno - 2].lstrip().startswith("#"):
        m = REASON.search(lines[lineno - 2])
    return m.group(1).strip() if m else None


def inner_imports() -> list[InnerImport]:
    """Every import inside a function body in autopar/, passes/ and cost_models/."""
    out = []
    for tree in TREES:
        for f in sorted((ROOT / tree).rglob("*.py")):
            text = f.read_text()
            lines = text.splitlines()
            found: list[ast.Import | ast.ImportFrom] = []

            def walk(node: ast.AST, in_function: bool, found=found) -> None:
                for child in ast.iter_child_nodes(node):
                    if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                        found.append(child)
                    walk(child, in_function or isinstance(
                        child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

            walk(ast.parse(text), False)
            rel = str(f.relative_to(ROOT))
            out += [InnerImport(rel, n.lineno, _module(n), _reason(lines, n.lineno))
                    for n in sorted(found, key=lambda n: n.lineno)]
    return out


def test_every_import_inside_a_function_gives_its_reason():
    missing = [f"{i.file}:{i.line}  {i.module}" for i in inner_imports() if i.reason is None]
    assert not missing, ("imports inside functions without a '# cycle: / # start-up: / "
                         "# optional:' reason (move them to the top of the module, or say "
                         "why they cannot go there):\n" + "\n".join(missing))


def test_a_reason_is_read_from_the_line_or_the_comment_above():
    lines = ["    # cycle: autopar.a imports this one", "    from autopar.a import x",
             "    from autopar.b import y  # start-up: b costs ~1 s to import",
             "    x = 1", "    from autopar.c import z"]
    assert _reason(lines, 2) == "cycle: autopar.a imports this one"
    assert _reason(lines, 3) == "start-up: b costs ~1 s to import"
    assert _reason(lines, 5) is None


if __name__ == "__main__":
    found = inner_imports()
    for i in found:
        print(f"{i.file}:{i.line}  {i.module}  {i.reason or 'NO REASON'}")
    kinds = Counter((i.reason or "none").split(":")[0] for i in found)
    print(f"{len(found)} imports inside functions: "
          + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
