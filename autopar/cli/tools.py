"""The CLI commands around a plan: ``autopar presets``, ``autopar explain``, ``autopar diff``.

``autopar plan`` (in :mod:`autopar.cli`) makes a plan; these read one back::

    autopar presets                       # the hardware presets and their numbers
    autopar explain plan.json             # the summary and why each decision was taken
    autopar explain plan.json zero linear_3 model.layers.0
    autopar diff a.json b.json            # what differs: layout, step, memory, nodes

``autopar plan ... --devices 8,16,32`` prints a scaling curve (:func:`run_scaling`).

A plan is a JSON file written by ``autopar plan --json`` / ``plan.to_json`` or an
export directory (its ``plan.json`` is read).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from autopar.cli.args import CLIError
from autopar.cost_models import PRESET_NAMES, MeshSpec, format_bytes
from autopar.errors import AutoparWarning
from autopar.log import show
from autopar.plans.data import Plan
from autopar.report.summary import render
from autopar.scaling import draw_scaling, scaling_curve, scaling_json, scaling_table
from autopar.search.budget import Phase

if TYPE_CHECKING:
    from autopar.plans.data import Plan


def read_plan(path: str) -> Plan:
    """A plan from a JSON file or an export directory; errors are
    :class:`~autopar.errors.LoadError` naming the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    return Plan.from_json(p)


def presets_table() -> str:
    """Every hardware preset with the numbers the cost model uses."""

    t = Table(title="hardware presets (--preset NAME; numbers per device)", title_justify="left")
    for col in ("preset", "default mesh", "GPUs/node", "peak TFLOP/s", "memory", "reserve", "HBM GB/s",
                "intra-node link", "inter-node link", "flat rings"):
        t.add_column(col, no_wrap=col == "preset", overflow="fold")

    def link(lk) -> str:
        return f"{lk.beta / 1e9:g} GB/s, {lk.alpha * 1e6:g} us" if lk is not None else "-"

    for name in PRESET_NAMES:
        m = MeshSpec.preset(name)
        t.add_row(name, "x".join(map(str, m.shape)), str(m.gpus_per_node or "one host"),
                  f"{m.peak_flops / 1e12:g}", format_bytes(m.mem_capacity),
                  format_bytes(m.mem_capacity - m.usable_memory),
                  f"{m.mem_bandwidth / 1e9:g}", link(m.intra or m.links[0]), link(m.inter),
                  ", ".join(k.replace("_", "-") for k in m.flat_ring) or "-")
    return render(t)


def cmd_presets(args) -> int:
    """``autopar presets``."""
    print(presets_table())
    return 0


def cmd_explain(args) -> int:
    """``autopar explain PLAN [NAME ...]``: without names, the summary and every
    decision's reason; with names, each one explained."""
    from autopar.cli.main import format_why  # cycle: autopar.cli.main imports this one

    p = read_plan(args.plan)
    if not args.names:
        print(p.summary())
        print()
        print(format_why(p))
        return 0
    for i, name in enumerate(args.names):
        try:
            text = p.explain(name)
        except KeyError as e:
            raise CLIError(f"explain {name}: {e.args[0]}") from None
        if i:
            print()
        print(text)
    return 0


def cmd_diff(args) -> int:
    """``autopar diff A B``."""
    a, b = read_plan(args.a), read_plan(args.b)
    print(a.diff(b, max_nodes=None if args.all else 30))
    return 0


def add_parsers(sub) -> None:
    """Register ``presets``, ``explain`` and ``diff`` on the CLI's subparsers."""
    p = sub.add_parser("presets", help="list the hardware presets and their numbers",
                       description="The hardware presets --preset accepts, with peak FLOP/s, "
                                   "memory and link numbers per device.")
    p.set_defaults(func=cmd_presets)
    p = sub.add_parser("explain", help="explain a saved plan: summary, decisions, nodes",
                       description="Read a plan (JSON file or export directory) and explain it: "
                                   "without NAME the summary and why each decision was taken; "
                                   "NAME is a decision (pipeline, zero, micro_batches, "
                                   "recompute), a layer key, a parameter or a graph node.",
                       epilog="example: autopar explain plan.json zero linear_3")
    p.add_argument("plan", metavar="PLAN", help="plan.json or an export directory")
    p.add_argument("names", nargs="*", metavar="NAME", help="what to explain (repeatable)")
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("diff", help="compare two saved plans",
                       description="What differs between two plans: layout, step time, memory, "
                                   "decisions, and the nodes whose placements differ.")
    p.add_argument("a", metavar="A", help="plan.json or an export directory")
    p.add_argument("b", metavar="B", help="plan.json or an export directory")
    p.add_argument("--all", action="store_true", help="list every differing node (default: 30)")
    p.set_defaults(func=cmd_diff)


def progress_wanted(args) -> bool:
    """Live progress: ``--progress``/``--no-progress``; by default on a terminal only,
    and never with ``--quiet``."""
    if args.quiet:
        return False
    return sys.stderr.isatty() if args.progress is None else args.progress


def format_timings(p: Plan, total: float) -> str:
    """Where the planning time went, nested as it was spent: capture (and annotation)
    once per micro-batch size, then the search; inside the search the placement ILP or
    D-Rec of every candidate, the rest being the choice of plan-level decisions; and for a
    joint search each phase's charged seconds against its share of ``time_limit``
    (:mod:`autopar.search.budget`; the confirm phase also gets what explore left)."""
    t = p.timings
    cap = t.get("capture", 0.0) + t.get("annotate", 0.0)
    placement = t.get("intra_op", t.get("enumerate_and_price", 0.0) + t.get("solve", 0.0))
    search = t.get("joint_search", total) - cap
    line = (f"planned in {total:.2f} s: capture {cap:.2f} s, search {search:.2f} s (op placement "
            f"{placement:.2f} s, plan-level decisions {max(0.0, search - placement):.2f} s)")
    phases = [f"{ph} {t[f'search_{ph}']:.2f} of {t[f'budget_{ph}']:.2f} s"
              for ph in Phase if f"search_{ph}" in t]
    return line + (f"; time_limit split: {', '.join(phases)}" if phases else "")


def setup_logging(args) -> None:
    """``-v``/``-vv``: the ``autopar`` logger at INFO/DEBUG on stderr."""
    level = {0: None, 1: logging.INFO}.get(getattr(args, "verbose", 0), logging.DEBUG)
    log = logging.getLogger("autopar")
    # handlers of earlier runs in this process go, with or without -v now: each is bound
    # to the sys.stderr of its run, which may be closed by now (a notebook, a test's
    # captured stream), and would print "--- Logging error ---" tracebacks
    for h in [h for h in log.handlers if getattr(h, "_autopar_cli", False)]:
        log.removeHandler(h)
    if level is None:
        log.setLevel(logging.NOTSET)
        log.propagate = True
        return
    log.setLevel(level)
    # our own handler on the current stderr (whatever the root logger has)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler._autopar_cli = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.propagate = False


@contextlib.contextmanager
def cli_warnings():
    """autopar's warnings as ``autopar: warning: ...`` lines on stderr: at the command
    line there is no user code to point at, so file and line would only name our entry
    point."""
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, AutoparWarning):
            text = str(message).removeprefix("autopar: ")
            print(f"autopar: warning: {text}", file=sys.stderr)
        else:
            old(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = old


__all__ = ["add_parsers", "cli_warnings", "format_timings", "progress_wanted", "setup_logging", "cmd_diff", "cmd_explain", "cmd_presets", "presets_table", "read_plan"]


def run_scaling(args, model, inputs: tuple, kwargs: dict | None, counts: list[int], preset: str,
                options: dict) -> int:
    """``autopar plan ... --devices 8,16,32``: the scaling curve
    (:func:`autopar.scaling.scaling_curve`) as a table, ``--json`` and ``--scaling``."""
    t0 = time.perf_counter()
    with show(progress_wanted(args), args.time_limit):
        points = scaling_curve(model, inputs, example_kwargs=kwargs, preset=preset, devices=counts,
                               time_limit=args.time_limit, progress=False, **options)
    if args.format == "json":
        print(scaling_json(points))
    else:
        print(f"scaling on {preset}: the best plan at each device count, the batch of "
              f"{points[0].batch} at {counts[0]} devices kept per device; (est.): priced from the "
              "model's shallow copy, as the search explores")
        print(scaling_table(points))
        if not args.quiet:
            print(f"searched in {time.perf_counter() - t0:.1f} s")
    for out, write in ((args.json, lambda path: Path(path).write_text(scaling_json(points) + "\n")),
                       (args.scaling, lambda path: draw_scaling(points, path))):
        if out:
            try:
                write(out)
            except OSError as e:
                raise CLIError(f"cannot write {out}: {e.strerror or e}") from None
            print(f"scaling curve written to {out}", file=sys.stderr)
    return 0
