"""``autopar check``: train the best few candidate plans for a few steps on the live job,
report predicted against measured step time and pick the measured fastest
(:func:`autopar.verify.verify`).

It runs the candidates, so it runs under torchrun, one process per device::

    torchrun --nproc-per-node 2 --no-python autopar check examples/gpt.py:build \\
        --factory-args layers=2 --k 3 --steps 3 --store measurements.jsonl --json check.json

The mesh defaults to the world as one axis (``--mesh``, ``--preset``, ``--mesh-json`` as
for ``autopar plan``).  The candidates are the search's plan and its variants, or the
saved plans given with ``--candidates a.json b.json``.  Rank 0 prints the table, the
Spearman rank correlation and the chosen plan's summary; ``--json`` writes the report
with the chosen plan whole (its ``plan`` entry loads with ``Plan.from_dict``), and
``--store`` appends one JSON line per candidate for a later calibration.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from autopar.cli.args import CLIError, _literal, parse_bytes, parse_kv, parse_pins
from autopar.cli.main import build_model, load_factory, make_mesh
from autopar.cli.tools import read_plan
from autopar.errors import LoadError
from autopar.verify import PICKS, verify


def cmd_check(args) -> int:
    """``autopar check``: shortlist, measure, report; rank 0 prints."""
    world = require_torchrun("autopar check measures candidate plans on the live job",
                             "torchrun --nproc-per-node 2 --no-python autopar check FILE.py ...")
    for flag, value, least in (("--k", args.k, 1), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            raise CLIError(f"{flag} must be >= {least}, got {value}")
    if args.pick not in PICKS:  # argparse's choices already say so; kept for direct callers
        raise CLIError(f"--pick must be one of {', '.join(PICKS)}")
    if not args.mesh and not args.mesh_json:
        args.mesh = str(world)  # the whole job as one axis (a preset's default may differ)
    mesh = make_mesh(args)
    if mesh.size != world:
        raise CLIError(f"the mesh {'x'.join(map(str, mesh.shape))} has {mesh.size} devices but "
                       f"torchrun started {world} processes")
    pins = parse_pins(args.pin)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    fargs = {k: _literal(v) for k, v in parse_kv(args.factory_args, "--factory-args").items()}
    candidates = _read_plans(args.candidates) if args.candidates else None
    module, factory = load_factory(args.target)
    model, inputs, kwargs = build_model(module, factory, fargs, args.target)
    try:
        report = verify(model, inputs, mesh, example_kwargs=kwargs, k=args.k, steps=args.steps,
                        warmup=args.warmup, pick=args.pick, store=args.store, candidates=candidates,
                        pins=pins or None, memory_budget=budget, time_limit=args.time_limit)
        if dist.get_rank() == 0:
            print(report.table())
            print()
            print(report.plan.summary())
            if args.store:
                print(f"measurements appended to {args.store}")
            if args.json:
                try:
                    with open(args.json, "w") as f:
                        json.dump(report.to_dict(), f, indent=1)
                except OSError as e:
                    raise CLIError(f"cannot write {args.json}: {e.strerror or e}") from None
                print(f"report written to {args.json}")
        sys.stdout.flush()
    finally:
        leave()
    return 0


def _read_plans(paths: list[str]) -> list:
    """``--candidates``: saved plans (JSON files or export directories), every rank
    reading them (verify measures rank 0's)."""

    out = []
    for path in paths:
        try:
            out.append(read_plan(path))
        except LoadError as e:  # names the file and what is wrong (missing, bad schema)
            raise CLIError(f"--candidates: {e}") from None
    return out


def require_torchrun(why: str, example: str) -> int:
    """The world size torchrun set; a :class:`CLIError` saying ``why`` and showing
    ``example`` when the command was not started by torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CLIError(f"{why}: run it under torchrun, one process per device, e.g. {example}")
    return int(os.environ["WORLD_SIZE"])


def leave() -> None:
    """End the process group verify joined, with every rank there (rank 0 may still be
    writing), so no gloo thread outlives the interpreter."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def add_parser(sub) -> None:
    """Register ``check`` on the CLI's subparsers."""
    p = sub.add_parser(
        "check", help="measure the best k candidate plans on the live job (under torchrun)",
        description="Plan the model built by FACTORY, train the k plans the cost model ranks "
                    "best for a few steps each on this job, report predicted against measured "
                    "step time (a table and Spearman) and pick one.  Run it under torchrun.",
        epilog="example: torchrun --nproc-per-node 2 --no-python autopar check "
               "examples/gpt.py:build --k 3 --store measurements.jsonl")
    p.add_argument("target", metavar="FILE.py[:FACTORY]",
                   help="Python file and the factory in it (default: build), as for autopar plan")
    p.add_argument("--factory-args", nargs="+", default=[], metavar="K=V",
                   help="keyword arguments for the factory (Python literals or strings)")
    p.add_argument("--mesh", help="mesh shape, e.g. 4 or 2x2 (default: the world as one axis)")
    p.add_argument("--preset", help="hardware preset the plans are priced on (default: cpu-gloo)")
    p.add_argument("--mesh-json", help="mesh description written by MeshSpec.to_json or "
                   "autopar calibrate (--mesh then reshapes it)")
    p.add_argument("--pin", action="append", default=[], metavar="NAME=PLACEMENTS",
                   help="fix a placement in every candidate, e.g. fc1.weight=S(0) (repeatable)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="bytes per device, e.g. 40GiB (default: the device's capacity less the preset's reserve)")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="SECONDS",
                   help="search time limit per candidate plan (default 30)")
    p.add_argument("--candidates", nargs="+", metavar="PLAN",
                   help="measure these saved plans (plan.json from autopar plan --json, or "
                        "export directories) instead of the search's plan and its variants")
    p.add_argument("--k", type=int, default=5, help="candidates to measure (default 5)")
    p.add_argument("--steps", type=int, default=3,
                   help="timed training steps per candidate; the median counts (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps before them (default 1)")
    p.add_argument("--pick", choices=PICKS, default="measured",
                   help="measured: the measured fastest (default); predicted: the cost model's best")
    p.add_argument("--store", metavar="PATH.jsonl",
                   help="append one JSON line per candidate (predicted, measured, decisions, "
                        "mesh) for a later calibration")
    p.add_argument("--json", metavar="OUT.json", help="write the report as JSON (rank 0)")
    p.set_defaults(func=cmd_check)


__all__ = ["add_parser", "cmd_check"]
