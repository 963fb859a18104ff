"""Search time and plan cost of the ILP and D-Rec searchers as GPT models and meshes grow.

GPT-style models (``examples/gpt.py``) of 12, 24, 48 and 96 layers, built on the meta
device (no weights are allocated), on meshes of 8, 64, 256 and 1,024 devices: one node
``(8,)`` of preset ``8xA100-nvlink`` and 2-D hierarchical meshes ``(8, 8)``, ``(32, 8)``,
``(128, 8)`` of ``multinode-a100-ib`` (inter-node axis first). Both searchers run side by
side on the same captured graph, and for the ILP the clustered solve (repeated layers,
``autopar/search/solvers/cluster.py``) is compared with the flat one on the same problem::

    python benchmarks/search_scaling.py --layers 12 24 --devices 8 64   # prints the table
    python benchmarks/search_scaling.py --write         # everything, and updates the docs

Each model runs in its own subprocess: it is captured once (capture and annotate are
timed separately from the search), then every (mesh, searcher) cell calls
:func:`autopar.search.op_placement.make_plan`, whose wall time is the "search" time (enumerate, price,
solve and assemble the Plan). The search only chooses intra-op sharding (no pipeline or
recompute), so by default the memory budget is off: a GPT-3-size model's activations do not
fit in 80 GiB per device without pipelining; ``--memory-budget capacity`` turns the
device's capacity back on. A model's subprocess has a wall-clock limit; ILP cells whose
time, extrapolated linearly in depth from the previous model on the same mesh, would
exceed ``--cell-limit`` are skipped and marked, as are flat-ILP comparisons.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import machine, regenerate, write_section  # noqa: E402  (same folder, shared helpers)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Search scaling (benchmarks/search_scaling.py)"
# GPT-3 family shapes (Brown et al. 2020, table 2.1; 48 layers is Alpa's GPT-39B).
MODELS = {12: (768, 12), 24: (2048, 16), 48: (8192, 64), 96: (12288, 96)}
SEQ, VOCAB = 2048, 50304
MESHES = {8: ("8xA100-nvlink", (8,)), 64: ("multinode-a100-ib", (8, 8)),
          256: ("multinode-a100-ib", (32, 8)), 1024: ("multinode-a100-ib", (128, 8))}
SEARCHERS = ("ilp", "drec")


# ---------------------------------------------------------------- one model (child)
def _flat_ilp(gm, mesh, budget: float | None, time_limit: float) -> dict:
    """The same ILP without clustering or shared pricing, for the comparison column."""
    from autopar.search.node_prices import CostModel
    from autopar.search.op_placement import _solve, build_problem
    from autopar.sharding.strategies import enumerate_strategies

    t0 = time.perf_counter()
    strategies = enumerate_strategies(gm, tuple(mesh.shape))
    cm = CostModel(mesh)
    pb = build_problem(gm, mesh, strategies, cm, math.inf if budget is None else budget)
    sol = _solve(pb.problem, time_limit)
    return {"seconds": time.perf_counter() - t0, "objective_ms": sol.objective * 1e3,
            "status": str(sol.status), "gap": sol.gap}


def measure_model(layers: int, devices: list[int], time_limit: float, budget: float | None,
                  skip: list[str], out: Path) -> None:
    """Capture one model and run every cell, appending one JSON line per result to ``out``."""
    import torch

    from autopar import MeshSpec
    from autopar.capture.annotate import annotate
    from autopar.capture.trace import capture
    from autopar.plans.decisions import PlanOptions
    from autopar.search.op_placement import make_plan

    sys.path.insert(0, str(ROOT))
    from examples.gpt import build

    def emit(rec: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    dim, heads = MODELS[layers]
    with torch.device("meta"):
        # one sequence per device of the largest mesh keeps every batch split possible
        model, ex = build(layers=layers, dim=dim, heads=heads, vocab=VOCAB, seq=SEQ,
                          batch=max(devices))
    params = sum(p.numel() for p in model.parameters())
    cap = capture(model, ex)
    t0 = time.perf_counter()
    annotate(cap.gm)
    emit({"kind": "model", "layers": layers, "dim": dim, "params": params,
          "graph_nodes": len(cap.gm.graph.nodes), "capture": cap.seconds,
          "annotate": time.perf_counter() - t0})
    for n in devices:
        preset, shape = MESHES[n]
        mesh = MeshSpec.preset(preset, shape=shape)
        for searcher in SEARCHERS:
            rec = {"kind": "cell", "layers": layers, "devices": n, "searcher": searcher}
            if f"{searcher}:{n}" in skip:
                emit({**rec, "skipped": f"predicted over the {time_limit:g} s cell limit"})
                continue
            t0 = time.perf_counter()
            try:
                # budget None means "off" here, which make_plan spells inf (None = the device less its reserve)
                opts = PlanOptions(memory_budget=math.inf if budget is None else budget,
                                   time_limit=time_limit, search=searcher)
                p = make_plan(cap.gm, mesh, cap.aliases, opts)
            except Exception as e:  # noqa: BLE001 - a cell's failure is a table entry
                emit({**rec, "error": f"{type(e).__name__}: {str(e)[:160]}",
                      "seconds": time.perf_counter() - t0})
                continue
            s = p.solver
            rec.update(seconds=time.perf_counter() - t0, solve=p.timings.get("solve"),
                       objective_ms=p.objective * 1e3, status=s.status, gap=s.gap,
                       backend=s.backend, searcher_used=s.searcher, message=s.message,
                       memory_gib=p.memory.get("total", 0.0) / 2**30)
            if searcher == "ilp" and f"flat:{n}" not in skip:
                rec["flat"] = _flat_ilp(cap.gm, mesh, budget, time_limit)
            emit(rec)


# ---------------------------------------------------------------- parent
def run_model(layers: int, devices: list[int], time_limit: float, budget: float | None,
              skip: list[str], model_timeout: float) -> list[dict]:
    """Run one model's cells in a subprocess; cells it did not reach become timeouts."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "res.jsonl"
        cmd = [sys.executable, __file__, "--_child", str(layers), "--_out", str(out),
               "--devices", *map(str, devices), "--cell-limit", str(time_limit),
               "--memory-budget", "none" if budget is None else repr(budget),
               "--_skip", *skip]
        t0 = time.perf_counter()
        err = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=model_timeout)
            if proc.returncode != 0:
                tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
                err = f"failed (exit {proc.returncode}): {tail[0][:160]}"
        except subprocess.TimeoutExpired:
            err = f"model timed out after {model_timeout:g} s"
        recs = [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []
    done = {(r["devices"], r["searcher"]) for r in recs if r["kind"] == "cell"}
    for n in devices:
        for s in SEARCHERS:
            if (n, s) not in done:
                recs.append({"kind": "cell", "layers": layers, "devices": n, "searcher": s,
                             "error": err or "not run", "seconds": time.perf_counter() - t0})
    return recs


def _skips(prev: list[dict], layers: int, time_limit: float) -> list[str]:
    """ILP / flat-ILP cells predicted (linear in depth) to run past the cell limit."""
    out = []
    for r in prev:
        if r["kind"] != "cell" or r["searcher"] != "ilp":
            continue
        scale = layers / r["layers"]
        if "skipped" in r or r.get("seconds", 0) * scale > time_limit:
            out.append(f"ilp:{r['devices']}")
        flat = r.get("flat")
        if "skipped" in r or flat is None or flat["seconds"] * scale > time_limit:
            out.append(f"flat:{r['devices']}")
    return out


# ---------------------------------------------------------------- reporting
def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "skipped" in r:
        return "skipped (over limit)"
    if "error" in r:
        return r["error"]
    gap = r.get("gap")
    status = r["status"] + (f", gap {gap:.1%}" if gap else "")
    return f"{r['seconds']:.2f} s, {r['objective_ms']:.1f} ms ({status})"


def _flat(r: dict | None) -> str:
    if r is None or "flat" not in r:
        return "skipped" if r is not None and "error" not in r else "-"
    f = r["flat"]
    same = "same" if math.isclose(f["objective_ms"], r["objective_ms"], rel_tol=1e-9) else \
        f"{(r['objective_ms'] / f['objective_ms'] - 1):+.3%}"
    return f"{f['seconds']:.2f} s ({same})"


HEADER = ("| layers | params | devices (mesh) | capture + annotate s | ILP (clustered) | "
          "flat ILP | D-Rec | D-Rec / ILP cost |")
RULE = "|---:|---:|---|---:|---|---|---|---:|"


def table(recs: list[dict]) -> list[str]:
    """Markdown rows: one per (model, mesh)."""
    models = {r["layers"]: r for r in recs if r["kind"] == "model"}
    cells = {(r["layers"], r["devices"], r["searcher"]): r for r in recs if r["kind"] == "cell"}
    rows = []
    for (layers, n) in sorted({(k[0], k[1]) for k in cells}):
        m = models.get(layers)
        ilp, drec = cells.get((layers, n, "ilp")), cells.get((layers, n, "drec"))
        ratio = "-"
        if ilp and drec and "objective_ms" in ilp and "objective_ms" in drec:
            ratio = f"{drec['objective_ms'] / ilp['objective_ms']:.3f}"
        shape = "x".join(map(str, MESHES[n][1]))
        rows.append(
            f"| {layers} | {m['params'] / 1e9:.2f}B | {n} ({shape}) | "
            f"{m['capture']:.1f} + {m['annotate']:.2f} | {_cell(ilp)} | {_flat(ilp)} | "
            f"{_cell(drec)} | {ratio} |" if m else
            f"| {layers} | - | {n} ({shape}) | - | {_cell(ilp)} | {_flat(ilp)} | {_cell(drec)} | {ratio} |")
    return rows


def section(recs: list[dict], time_limit: float, budget: float | None, command: str = "") -> str:
    """The markdown section for ``docs/benchmarks.md`` (``command``: its last line,
    ``plan_time.regenerate``'s)."""
    models = ", ".join(f"{n} layers dim {d} ({h} heads)" for n, (d, h) in MODELS.items())
    lines = [
        SECTION,
        "",
        f"Search time and predicted step time for `examples/gpt.py` models built on the meta "
        f"device ({models}; seq {SEQ}, vocab {VOCAB}, one sequence per device of the largest "
        f"mesh) on meshes `8xA100-nvlink` 8 and `multinode-a100-ib` 8x8, 32x8, 128x8 "
        f"(inter-node axis first). A cell is `make_plan` wall seconds (enumerate, price, solve, "
        f"assemble) and the plan's predicted step time; capture and annotate run once per model "
        f"and are listed apart. Memory budget: "
        f"{'off (intra-op only: no pipeline or recompute)' if budget is None else f'{budget:g} B'}; "
        f"cell limit {time_limit:g} s.",
        "",
        f"Measured {_dt.date.today().isoformat()} on: {machine()}.",
        "",
        HEADER,
        RULE,
        *table(recs),
        "",
        "\"ILP (clustered)\" is the exact search with repeated-layer clustering and shared "
        "pricing; \"flat ILP\" enumerates, prices and solves the same problem without either "
        "(no assemble, so it skips the ~1 s of plan assembly a 96-layer cell pays; its time, "
        "and whether its optimum equals the clustered one); \"D-Rec / ILP cost\" is the ratio of predicted "
        "step times. A skipped cell was predicted (linearly in depth from the previous model) "
        "to exceed the cell limit.",
        "",
        command or regenerate("search_scaling.py", []),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=list(MODELS))
    ap.add_argument("--devices", type=int, nargs="+", default=list(MESHES))
    ap.add_argument("--cell-limit", type=float, default=60.0,
                    help="solver time limit and skip threshold per cell (s)")
    ap.add_argument("--memory-budget", default="none",
                    help="'none' (default), 'capacity' (the device's) or bytes per device")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--_child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_skip", nargs="*", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--hf", action="store_true",
                    help="Hugging Face Llama 8B/70B shapes instead (benchmarks/search_scaling_hf.py)")
    given = list(sys.argv[1:] if argv is None else argv)
    if "--hf" in given:  # its own options (--models, --devices, --cell-limit, --write)
        from search_scaling_hf import main as hf_main
        return hf_main([a for a in given if a != "--hf"])
    args = ap.parse_args(given)
    budget = {"none": None, "capacity": None}.get(args.memory_budget)
    if args.memory_budget not in ("none", "capacity"):
        budget = float(args.memory_budget)
    if args.memory_budget == "capacity":
        budget = 80.0 * 2**30  # both presets are 80 GiB devices
    if args._child is not None:
        measure_model(args._child, args.devices, args.cell_limit, budget, args._skip, Path(args._out))
        sys.stdout.flush()
        # a solver abandoned at its deadline may still run in a worker thread
        os._exit(0)

    recs: list[dict] = []
    for n in args.layers:
        print(f"GPT {n} layers ...", file=sys.stderr, flush=True)
        skip = _skips([r for r in recs if r.get("layers") == max(
            (x for x in args.layers if x < n), default=-1)], n, args.cell_limit)
        # each cell may use its limit, the flat comparison too, plus capture
        timeout = 60 + len(args.devices) * 3 * args.cell_limit
        got = run_model(n, args.devices, args.cell_limit, budget, skip, timeout)
        recs += got
        for row in table(got):
            print(row, file=sys.stderr, flush=True)
    print("\n".join([HEADER, RULE, *table(recs)]))
    if args.json:
        Path(args.json).write_text(json.dumps(recs, indent=1))
    if args.write:
        write_section(section(recs, args.cell_limit, budget, regenerate("search_scaling.py", argv)))
        print(f"updated {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
