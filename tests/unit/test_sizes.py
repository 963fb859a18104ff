"""The size marks a reader relies on: no function over 80 lines and no module over 500 in
``autopar/``, ``passes/``, ``cost_models/`` and ``tests/``, and ``docs/benchmarks.md`` at
most 400 lines.

``python tests/unit/test_sizes.py`` prints the longest functions and modules and the
counts over the marks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("autopar", "passes", "cost_models", "tests")
FUNCTION_LINES, MODULE_LINES, BENCHMARKS_LINES = 80, 500, 400


def sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, "file:function") of every function and (lines, file) of every module, longest first."""
    functions, modules = [], []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            text = path.read_text()
            modules.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    functions.append((node.end_lineno - start + 1, f"{rel}:{node.name}"))
    return sorted(functions, reverse=True), sorted(modules, reverse=True)


def test_functions_and_modules_within_their_marks() -> None:
    functions, modules = sizes()
    assert not [f for f in functions if f[0] > FUNCTION_LINES], functions[:5]
    assert not [m for m in modules if m[0] > MODULE_LINES], modules[:5]


def test_benchmarks_page_within_its_mark() -> None:
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= BENCHMARKS_LINES, lines


if __name__ == "__main__":
    fs, ms = sizes()
    print("longest functions:", *(f"  {n} {name}" for n, name in fs[:5]), sep="\n")
    print("longest modules:", *(f"  {n} {name}" for n, name in ms[:5]), sep="\n")
    bench = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    print(f"functions over {FUNCTION_LINES} lines: {sum(n > FUNCTION_LINES for n, _ in fs)}; "
          f"modules over {MODULE_LINES} lines: {sum(n > MODULE_LINES for n, _ in ms)}; "
          f"docs/benchmarks.md: {bench} lines")
