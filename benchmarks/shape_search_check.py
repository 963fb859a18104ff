"""The searched mesh shape against the named shapes' own searches, and its planning time.

For every case of the published suites (:mod:`published_suites`: Alpa's and Mist's GPT
runs, ``explore=True``, two blocks captured, 1,800 s limit, as that benchmark plans them;
the two Alpa 39B rows are one model and one device count, so one case) and the Llama-3
cells of :mod:`mesh_search` (8B and 70B on 64 and 1,024 devices, the library's default
limit), this plans:

* **named**: each named shape by its own (fixed-shape) search: the suites' published mesh
  and (nodes, 8), the Llama cells' three hand-picked shapes;
* **before**: ``MeshSpec.preset(name, devices=N)`` (the shape searched) with the shape
  search of an earlier commit (``--before-rev``, default main's ``a2d8123``), its
  ``autopar/search/mesh_shapes.py`` loaded in place of this checkout's;
* **after**: the same with this checkout's shape search.

Each result is appended as one JSON line to ``--results`` (so a long run can be resumed
with ``--only``), and the table of every result in that file is printed: the searched
shape's step against the best named one's, the ratio, and planning seconds before and
after.  It does not rewrite the docs::

    OMP_NUM_THREADS=1 python benchmarks/shape_search_check.py --results /tmp/shapes.jsonl
    python benchmarks/shape_search_check.py --results /tmp/shapes.jsonl --cases "Alpa 39B" --only after
    python benchmarks/shape_search_check.py --results /tmp/shapes.jsonl --table   # print only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import published_suites as ps  # noqa: E402  (same folder)
from mesh_search import HAND  # noqa: E402
from mesh_search import PRESET as LLAMA_PRESET  # noqa: E402
from plan_time import machine  # noqa: E402

KINDS = ("named", "before", "after")
LLAMA_CELLS = ("8B:64", "70B:64", "8B:1024", "70B:1024")


def suite_cases() -> dict[str, ps.Run]:
    """One case per (model, device count) of the published suites."""
    out: dict[str, ps.Run] = {}
    for run in ps.RUNS:
        key = f"{run.suite} {run.name.split(' (')[0]}"
        out.setdefault(key, run)
    return out


def case_names() -> list[str]:
    """Every case, suites first."""
    return list(suite_cases()) + [f"Llama {c}" for c in LLAMA_CELLS]


def named_shapes(case: str) -> list[tuple[int, ...]]:
    """The shapes a user would name for ``case``."""
    if case.startswith("Llama"):
        return [tuple(s) for s in HAND[int(case.split(":")[1])]]
    run = suite_cases()[case]
    return list(dict.fromkeys([tuple(run.shape), *map(tuple, run.our_shapes())]))


def use_shape_search(rev: str | None) -> None:
    """Plan searched shapes with ``rev``'s shape search (``None``: this checkout's)."""
    import autopar.search.entry as entry
    from autopar.search import mesh_shapes

    if rev is None:
        entry.ShapeSearch = mesh_shapes.ShapeSearch
        return
    src = subprocess.run(["git", "show", f"{rev}:autopar/search/mesh_shapes.py"], cwd=HERE.parent,
                         capture_output=True, text=True, check=True).stdout
    old = sys.modules.setdefault("mesh_shapes_before", types.ModuleType("mesh_shapes_before"))
    exec(compile(src, f"{rev}:autopar/search/mesh_shapes.py", "exec"), old.__dict__)  # noqa: S102
    entry.ShapeSearch = old.ShapeSearch


def _llama(case: str):
    import torch
    from search_scaling_hf import _model

    name, n = case.split()[1].split(":")
    ids = torch.zeros((int(n), 2048), dtype=torch.long, device="meta")
    return _model(name), (), dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="bf16-mixed",
                                  batch="local"), LLAMA_PRESET, int(n)


def _suite(case: str):
    run = suite_cases()[case]
    model, ex = ps.build_model(run, run.batch)
    return model, ex, dict(search="ilp", blocks=run.layers, time_limit=1800.0, precision=ps.PRECISION,
                           explore=True), run.preset, run.gpus


_BUILT: dict[str, tuple] = {}


def plan_one(case: str, kind: str, shape: tuple[int, ...] | None, rev: str) -> dict:
    """Plan ``case`` on ``shape`` (named) or searched (before / after); its result row."""
    import autopar
    from autopar import MeshSpec

    if case not in _BUILT:
        _BUILT[case] = _llama(case) if case.startswith("Llama") else _suite(case)
        model, ex, kw, preset, n = _BUILT[case]
        try:  # torch.export's and the model's one-time set-up, untimed
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                autopar.plan(model, ex, MeshSpec.preset(preset, shape=named_shapes(case)[0]),
                             **{**kw, "time_limit": 1.0})
        except Exception:  # noqa: BLE001 - only the set-up counts
            pass
    model, ex, kw, preset, n = _BUILT[case]
    use_shape_search(rev if kind == "before" else None)
    mesh = MeshSpec.preset(preset, shape=shape) if kind == "named" else MeshSpec.preset(preset, devices=n)
    t0, c0 = time.perf_counter(), time.process_time()
    row = dict(case=case, kind=kind, shape=list(shape) if shape else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = autopar.plan(model, ex, mesh, **kw)
        row.update(step=p.decisions.step_seconds, chosen=list(p.request.mesh_shape),
                   why=p.decisions.why.get("mesh", ""))
    except Exception as e:  # noqa: BLE001 - a failure is a row of the table
        row.update(step=None, error=f"{type(e).__name__}: {e}"[:200])
    row["seconds"], row["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    return row


def table(rows: list[dict]) -> str:
    """Markdown table: per case, the searched step after, the best named step, their
    ratio, and planning seconds before and after (the latest row of each kind)."""
    last: dict[tuple, dict] = {}
    for r in rows:
        last[(r["case"], r["kind"], tuple(r["shape"] or ()))] = r
    lines = ["| case | devices | searched: shape, step s | best named: shape, step s | ratio | "
             "before: shape, step s | CPU s before | CPU s after | after / before |",
             "|---|---:|---|---|---:|---|---:|---:|---:|"]
    for case in case_names():
        named = [r for (c, k, _), r in last.items() if c == case and k == "named" and r["step"]]
        before, after = last.get((case, "before", ())), last.get((case, "after", ()))
        if not after or not after["step"]:
            continue
        best = min(named, key=lambda r: r["step"]) if named else None
        n = math.prod(after["chosen"])
        ratio = f"{after['step'] / best['step']:.3f}" if best else "-"
        lines.append(f"| {case} | {n} | {_cell(after['chosen'], after)} | "
                     f"{_cell(best['shape'], best) if best else '-'} | {ratio} | "
                     f"{_cell(before['chosen'], before) if before and before['step'] else '-'} | "
                     f"{_cpu(before)} | {_cpu(after)} | "
                     + (f"{_cpu_of(after) / _cpu_of(before):.2f} |" if before else "- |"))
    return "\n".join(lines)


def _cell(shape: list[int], row: dict) -> str:
    return f"{'x'.join(map(str, shape))}: {row['step']:.3f}"


def _cpu_of(row: dict) -> float:
    """CPU seconds of a planning call (the work, whatever else the machine runs); wall
    seconds for rows measured without them."""
    return row.get("cpu", row["seconds"])


def _cpu(row: dict | None) -> str:
    return f"{_cpu_of(row):.1f}" if row else "-"


def main(argv: list[str] | None = None) -> int:
    """Plan the chosen cases and kinds, append the rows, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="JSON lines file the rows are appended to")
    ap.add_argument("--cases", nargs="+", default=case_names(), choices=case_names())
    ap.add_argument("--only", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--before-rev", default="a2d8123")
    ap.add_argument("--table", action="store_true", help="print the table of --results only")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    path = Path(a.results)
    if not a.table:
        print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
        for case in a.cases:
            jobs = [("named", s) for s in named_shapes(case)] if "named" in a.only else []
            jobs += [(k, None) for k in ("before", "after") if k in a.only]
            for kind, shape in jobs:
                row = plan_one(case, kind, shape, a.before_rev)
                with path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{case} {kind} {shape or ''}: {row['step']} in {row['seconds']:.1f} s "
                      f"{row.get('error', '')}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    print(machine())
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
