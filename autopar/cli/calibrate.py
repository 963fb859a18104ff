"""``autopar calibrate``: measure the running cluster and write a MeshSpec JSON.

It measures the job it runs in, so it runs under torchrun, one process per device::

    torchrun --nproc-per-node 4 --no-python autopar calibrate --out mesh.json
    autopar plan examples/gpt.py:build --mesh-json mesh.json

Every rank joins the process group (gloo on CPU, NCCL with GPUs), measures per mesh axis
and per collective kind a latency-bandwidth curve, compute and the optimizer step with
every rank busy (:func:`autopar.cost_models.measure_cluster`); rank 0 prints what was
measured and writes the JSON (the MeshSpec plus a ``"calibration"`` record: when, on
which host, every sample and its spread).  ``--shape 2x2`` measures each axis of that
mesh over its own groups.

Once ``autopar check --mesh-json mesh.json --store m.jsonl`` has measured a few plans
priced with it, ``autopar calibrate --refine mesh.json --measurements m.jsonl --out
mesh2.json`` (no torchrun) rescales compute and communication to what those steps took
(:mod:`autopar.cost_models.refine`).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from autopar.cli.args import CLIError, parse_bytes
from autopar.cli.check import leave, require_torchrun
from autopar.cost_models import MeshSpec, measure_cluster
from autopar.cost_models.live import keep
from autopar.cost_models.refine import read_rows, refine
from autopar.verify import join

__all__ = ["add_parser", "cmd_calibrate"]


def cmd_calibrate(args) -> int:
    """``autopar calibrate``: measure on every rank, rank 0 writes and prints."""

    if args.refine:
        return _refine(args)
    world = require_torchrun("autopar calibrate measures the job it runs in",
                             "torchrun --nproc-per-node 4 --no-python autopar calibrate --out mesh.json")
    try:
        shape = MeshSpec.parse_shape(args.shape) if args.shape else None
    except ValueError as e:
        raise CLIError(f"--shape: {e}") from None
    if shape is not None and math.prod(shape) != world:
        raise CLIError(f"--shape {args.shape} has {math.prod(shape)} ranks but torchrun started {world}")
    if args.repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {args.repeats}")
    sizes = None
    if args.sizes:
        try:
            sizes = tuple(int(parse_bytes(s)) for s in args.sizes.split(","))
        except CLIError as e:
            raise CLIError(f"--sizes: {e}") from None
        if any(s < 4 for s in sizes):
            raise CLIError(f"--sizes must be at least 4 bytes each, got {args.sizes}")
    try:
        base = MeshSpec.preset(args.preset) if args.preset else None
    except ValueError as e:  # names the known presets
        raise CLIError(f"--preset: {e}") from None
    join()
    try:
        try:
            record = measure_cluster(sizes=sizes, repeats=args.repeats, base=base, shape=shape)
        except ValueError as e:  # raised alike on every rank, before any collective
            raise CLIError(str(e)) from None
        if dist.get_rank() == 0:
            print(record.table())
            try:
                record.to_json(args.out)
            except OSError as e:
                raise CLIError(f"cannot write {args.out}: {e.strerror or e}") from None
            print(f"mesh written to {args.out} (use it with --mesh-json {args.out})")
        if args.keep:
            kept = keep(record, shape or (world,))
            if kept is not None:
                print(f"kept as this cluster's calibration in {kept}: auto_parallel plans on "
                      "it when no mesh description is named")
    finally:
        leave()  # rank 0 may still be writing: every rank waits for it
    return 0


def _refine(args) -> int:
    """``--refine MESH.json --measurements M.jsonl``: no torchrun, no measuring; rescale
    the mesh to the steps ``autopar check --store`` measured with it."""

    if not args.measurements:
        raise CLIError("--refine needs --measurements M.jsonl (written by autopar check --store)")
    try:
        spec = MeshSpec.from_json(args.refine)
        r = refine(spec, read_rows(args.measurements))
    except OSError as e:
        raise CLIError(f"cannot read {e.filename}: {e.strerror or e}") from None
    except ValueError as e:
        raise CLIError(str(e)) from None
    print(f"refined {args.refine} from {r.rows} measured plans: compute x{r.compute_scale:.2f}, "
          f"communication x{r.comm_scale:.2f}; median error {100 * r.error_before:.0f}% -> "
          f"{100 * r.error_after:.0f}% on those plans")
    try:
        r.spec.to_json(args.out)
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"mesh written to {args.out}")
    return 0


def add_parser(sub) -> None:
    """Register ``calibrate`` on the CLI's subparsers."""
    p = sub.add_parser(
        "calibrate", help="measure the running cluster and write a MeshSpec JSON (under torchrun)",
        description="Measure collectives per mesh axis and kind over message sizes, compute "
                    "and the optimizer step on this job, every rank at once, and write the "
                    "MeshSpec that --mesh-json takes.  Run it under torchrun.",
        epilog="example: torchrun --nproc-per-node 4 --no-python autopar calibrate --out mesh.json")
    p.add_argument("--out", default="calibrated-mesh.json", metavar="PATH.json",
                   help="where rank 0 writes the mesh (default calibrated-mesh.json)")
    p.add_argument("--shape", help="mesh shape whose axes to measure, e.g. 2x2 (default: one axis)")
    p.add_argument("--repeats", type=int, default=5,
                   help="repetitions per message size; the median counts (default 5)")
    p.add_argument("--sizes", metavar="B,B,...",
                   help="message sizes, e.g. 4KiB,1MiB,4MiB (default 4KiB-4MiB on CPU, 64KiB-64MiB on GPU)")
    p.add_argument("--preset", help="preset supplying what is not measured (memory capacity)")
    p.add_argument("--keep", action="store_true",
                   help="also keep it as this cluster's calibration (autopar.cost_models.live): "
                        "auto_parallel with no mesh description then plans on it instead of "
                        "measuring its quick one")
    p.add_argument("--refine", metavar="MESH.json",
                   help="no measuring: rescale this mesh's compute and communication to the steps "
                        "--measurements holds (autopar check --store with this mesh); no torchrun")
    p.add_argument("--measurements", metavar="M.jsonl", help="measured plans for --refine")
    p.set_defaults(func=cmd_calibrate)
