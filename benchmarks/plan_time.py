"""How long planning takes, stage by stage, as a GPT-style model grows.

For GPT models (``examples/gpt.py``) of 4, 12, 24 and 48 layers on a 2x4 mesh
(preset ``8xA100-nvlink``) this measures capture, annotate, enumerate+price, solve and
lower (code generation) with :func:`autopar.api.build_parallel_module` and
``runtime=False`` (lowering without a process group) and prints a table; with
``--write`` it also rewrites its table in the section
"## Planning time (benchmarks/plan_time.py)" of ``docs/benchmarks.md``::

    python benchmarks/plan_time.py --layers 4 12     # prints
    python benchmarks/plan_time.py --write           # all sizes, and updates the docs

Each size runs in its own subprocess with a wall-clock limit (``--size-timeout``, default
300 s).  A size that runs past it is recorded as a timeout together with the stack it was
stuck in, rather than hanging the benchmark.  The solver has its own limit
(``--time-limit``, the library default of 30 s): a size that hits it still returns a plan,
and the table records the solver's status and gap.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Planning time (benchmarks/plan_time.py)"
STAGES = ("capture", "annotate", "enumerate_and_price", "solve", "lower")
DEFAULT_LAYERS = (4, 12, 24, 48)
MODEL = {"dim": 256, "heads": 8, "seq": 128, "batch": 16, "vocab": 1024}
MESH_PRESET, MESH_SHAPE = "8xA100-nvlink", (2, 4)


# ---------------------------------------------------------------- one size (child)
def measure(layers: int, time_limit: float) -> dict:
    """Plan and lower one GPT size in this process; return timings and solver facts."""
    import torch

    from autopar import MeshSpec
    from autopar.api import build_parallel_module
    from autopar.plans.decisions import PlanOptions

    sys.path.insert(0, str(ROOT))
    from examples.gpt import build

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model, ex = build(layers=layers, **MODEL)
    # counted before planning: the planner must not, but once did, shard the user's model
    params = sum(x.numel() for x in model.parameters())
    mesh = MeshSpec.preset(MESH_PRESET, shape=MESH_SHAPE)
    t0 = time.perf_counter()
    pm = build_parallel_module(model, ex, mesh, PlanOptions(time_limit=time_limit), runtime=False)
    total = time.perf_counter() - t0
    p = pm.plan
    s = p.solver
    return {
        "layers": layers,
        "params": params,
        "graph_nodes": len(p.nodes),
        "problem_nodes": s.problem_nodes,
        "problem_edges": s.problem_edges,
        "timings": {k: p.timings.get(k) for k in STAGES},
        "total": total,
        "status": s.status,
        "gap": s.gap,
        "backend": s.backend,
        "solver_message": s.message,
        "objective_ms": p.objective * 1e3,
    }


def _child(layers: int, time_limit: float, out: str, size_timeout: float) -> None:
    import faulthandler

    # Dump every thread's stack and exit shortly before the parent gives up, so a
    # timed-out size says where it was.
    faulthandler.dump_traceback_later(size_timeout, exit=True)
    res = measure(layers, time_limit)
    faulthandler.cancel_dump_traceback_later()
    Path(out).write_text(json.dumps(res))
    # A solver abandoned at its deadline may still be running in a worker thread;
    # do not wait for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _where(stderr: str) -> str:
    """The innermost autopar frame of the main thread in a faulthandler dump."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stderr)
    main = next((b for b in blocks if "Current thread" in b or "<module>" in b), stderr)
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main)
    for f, line, fn in frames:  # faulthandler prints innermost first
        if "autopar" in f or "/passes/" in f or "/cost_models/" in f:
            return f"{Path(f).name}:{line} in {fn}"
    return "unknown"


def run_size(layers: int, time_limit: float, size_timeout: float) -> dict:
    """Measure one size in a subprocess; a timeout becomes a row with ``error`` set."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        cmd = [sys.executable, __file__, "--_child", str(layers), "--_out", out,
               "--time-limit", str(time_limit), "--size-timeout", str(size_timeout)]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=size_timeout + 60)
            stderr, rc = proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = None
        wall = time.perf_counter() - t0
        if rc == 0 and os.path.exists(out):
            return json.loads(Path(out).read_text())
        if "Timeout (" in stderr or rc is None:
            err = f"timed out after {size_timeout:g} s (stuck in {_where(stderr)})"
        else:
            last = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
            err = f"failed (exit {rc}): {last[0][:200]}"
        return {"layers": layers, "error": err, "total": wall}


# ---------------------------------------------------------------- reporting
def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _solver(r: dict) -> str:
    if "error" in r:
        return r["error"]
    gap = r.get("gap")
    return r["status"] + (f" (gap {gap:.2%})" if gap else "") + f", {r['backend']}"


HEADER = ("| layers | params | graph nodes | problem nodes/edges | capture s | annotate s | "
          "enumerate+price s | solve s | lower s | total s | solver |")
RULE = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"


def markdown_row(r: dict) -> str:
    """One markdown table row for a result."""
    if "error" in r:
        return (f"| {r['layers']} | - | - | - | - | - | - | - | - | >{r['total']:.0f} | "
                f"{r['error']} |")
    t = r["timings"]
    return (f"| {r['layers']} | {r['params'] / 1e6:.1f}M | {r['graph_nodes']} | "
            f"{r['problem_nodes']}/{r['problem_edges']} | "
            + " | ".join(_fmt_s(t.get(k)) for k in STAGES)
            + f" | {r['total']:.2f} | {_solver(r)} |")


def text_table(results: list[dict]) -> str:
    """A plain-text table for the terminal."""
    cols = ("layers", "capture", "annotate", "enum+price", "solve", "lower", "total", "solver")
    rows = []
    for r in results:
        if "error" in r:
            rows.append((str(r["layers"]), "-", "-", "-", "-", "-", f">{r['total']:.0f}", r["error"]))
        else:
            t = r["timings"]
            rows.append((str(r["layers"]), *(_fmt_s(t.get(k)) for k in STAGES),
                         f"{r['total']:.2f}", _solver(r)))
    width = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, width))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, width)) for row in rows]
    return "\n".join(lines)


def machine() -> str:
    """A one-line description of the machine the numbers were taken on."""
    import torch
    from autopar.cost_models.live import cpu_model

    cpu = cpu_model()
    n = os.cpu_count()
    return (f"{n}-core CPU ({cpu}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


REGENERATE = "Regenerate with `python benchmarks/"
"""How the last line of every generated section starts (:func:`regenerate`): where
:func:`write_section` stops replacing."""


def regenerate(script: str, argv: list[str] | None = None) -> str:
    """The line that ends a generated section: the command that writes it again,
    ``script`` (a file of benchmarks/) with this run's arguments (``argv``, default
    ``sys.argv[1:]``) and ``--write``."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--write"]
    cmd = " ".join([f"python benchmarks/{script}", *map(shlex.quote, args), "--write"])
    return f"Regenerate with `{cmd}`."


def section(results: list[dict], time_limit: float, command: str = "") -> str:
    """The markdown section for ``docs/benchmarks.md`` (``command``: its last line,
    :func:`regenerate`'s)."""
    m = MODEL
    today = _dt.date.today().isoformat()
    lines = [
        SECTION,
        "",
        f"Wall-clock seconds per planning stage for `examples/gpt.py` `build(layers=N, "
        f"dim={m['dim']}, heads={m['heads']}, vocab={m['vocab']}, seq={m['seq']}, "
        f"batch={m['batch']})` on a {'x'.join(map(str, MESH_SHAPE))} mesh (preset "
        f"`{MESH_PRESET}`), measured with `build_parallel_module(..., runtime=False)` "
        f"(capture, plan and lower; no process group). Solver time limit {time_limit:g} s; "
        f"each size runs in a fresh process.",
        "",
        f"Measured {today} on: {machine()}.",
        "",
        HEADER,
        RULE,
        *(markdown_row(r) for r in results),
        "",
        "\"problem nodes/edges\" is the size of the strategy-selection problem handed to the "
        "solver before presolve; \"solver\" is `plan.solver.status` (a `feasible` status means "
        "the time limit ran out before optimality was proven; the gap is the remaining "
        "relative gap) and the MIP backend.",
        "",
        command or regenerate("plan_time.py", []),
        "",
    ]
    return "\n".join(lines)


def write_section(text: str, doc: Path = DOC) -> None:
    """Put a benchmark's generated block ``text`` in ``doc`` in place of the old one.

    ``text`` starts with the section's heading and ends with its :func:`regenerate`
    line.  The block replaced runs from that heading to the first line under it that
    starts with :data:`REGENERATE`; what follows that line under the same heading
    (notes written by hand) and every other section are kept.  A doc without the
    heading gets ``text`` appended.  A section without such a line (written before
    the blocks ended so) gets ``text`` under its heading and keeps its old text below
    it, to be tidied by hand: nothing is removed that this function did not write."""
    lines = text.rstrip("\n").splitlines()
    if not lines or not lines[-1].startswith(REGENERATE):
        raise ValueError(f"a generated section ends with a line starting {REGENERATE!r}")
    doc.parent.mkdir(parents=True, exist_ok=True)
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    have = old.splitlines(keepends=True)
    heading = lines[0].rstrip()
    start = next((i for i, ln in enumerate(have) if ln.rstrip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        nxt = next((j for j in range(start + 1, len(have)) if re.match(r"#{1,2} ", have[j])),
                   len(have))
        end = next((j for j in range(start + 1, nxt) if have[j].startswith(REGENERATE)), None)
        if end is None:
            print(f"{doc.name}: {heading!r} had no {REGENERATE!r} line: its old text is kept "
                  "below the new block", file=sys.stderr)
            end = start
        new = "".join(have[:start]) + text.rstrip("\n") + "\n" + "".join(have[end + 1:])
    doc.write_text(new.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver time limit (s)")
    ap.add_argument("--size-timeout", type=float, default=300.0,
                    help="wall-clock limit per model size (s)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--_child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child is not None:
        _child(args._child, args.time_limit, args._out, args.size_timeout)
        return 0

    results = []
    for n in args.layers:
        print(f"planning GPT with {n} layers ...", file=sys.stderr, flush=True)
        r = run_size(n, args.time_limit, args.size_timeout)
        results.append(r)
        print(text_table([r]).splitlines()[-1], file=sys.stderr, flush=True)
    print(text_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write:
        write_section(section(results, args.time_limit, regenerate("plan_time.py", argv)))
        print(f"updated {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
