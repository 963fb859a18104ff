"""Command-line interface: ``autopar plan path/to/file.py:factory --mesh 2x4``.

The factory is any callable in the file that returns ``(model, example_inputs)``, or
just the model when the file also defines ``example_inputs()``.  The file is loaded by
path (it need not be importable); ``--factory-args k=v`` are passed to the factory as
keyword arguments (values are Python literals, else strings)::

    autopar plan examples/gpt.py:build --mesh 2x4 --preset 8xA100-nvlink \\
        --factory-args layers=12 dim=256 --json plan.json --explain linear_3

Plan-level decisions are searched unless forced: ``--zero-stage``, ``--zero-axes``, ``--pipeline-stages``,
``--pipeline-axis``, ``--micro-batches``, ``--schedule``, ``--virtual-stages``, ``--recompute blocks.0,blocks.1`` (or ``none``);
``--explore`` also tries pipelines and micro-batches when the plain plan fits.  The
decisions are printed under the table; ``--explain`` alone prints why each was taken,
``--explain pipeline`` (or ``zero``, ``micro_batches``, ``recompute``, a layer key such as
``blocks.1``) one of them.

Errors the user can fix (missing file or factory, bad mesh or preset, bad pins, no
feasible plan, ...) print one ``error: ...`` line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import inspect
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from autopar.api import plan as make_plan
from autopar.cli.args import (
    CLIError,
    _literal,
    decision_options,
    device_counts,
    parse_bytes,
    parse_kv,
    parse_pins,
)
from autopar.cli.launch import add_parsers as launch_parsers
from autopar.cli.tools import (
    add_parsers,
    cli_warnings,
    format_timings,
    progress_wanted,
    run_scaling,
    setup_logging,
)
from autopar.cost_models import PRESET_NAMES, MeshSpec
from autopar.errors import AutoparError
from autopar.plans.data import versions
from autopar.report import timeline
from autopar.report.collective_table import format_collectives

if TYPE_CHECKING:
    from autopar.plans.data import Plan

__all__ = ["format_why", "load_factory", "main"]

def format_why(p: Plan) -> str:
    """``plan.decisions.why``: one sentence per decision (``--explain`` without a name)."""
    why = getattr(p.decisions, "why", None) or {}
    if not why:
        return "why: the plan records no reasons for its decisions"
    return "why:\n" + "\n".join(f"  {k}: {v}" for k, v in why.items())


# ---------------------------------------------------------------- loading the model
def _load_file(path: Path):
    if not path.exists():
        raise CLIError(f"no such file: {path}")
    if not path.is_file():
        raise CLIError(f"not a file: {path}")
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_autopar_user_{stem}_{abs(hash(str(path.resolve()))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered before executing so dataclasses and pickling inside the file work; the
    # file's own directory is importable while it runs, as for `python file.py`.
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise CLIError(f"loading {path} failed: {type(e).__name__}: {e}") from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def load_factory(target: str):
    """``"path/file.py:factory"`` -> (the loaded module, the factory callable).

    Without ``:factory`` the file's ``build`` is used."""
    path_text, sep, factory_name = target.rpartition(":")
    if not sep or not path_text or "/" in factory_name or factory_name.endswith(".py"):
        path_text, factory_name = target, "build"
    module = _load_file(Path(path_text))
    factory = getattr(module, factory_name, None)
    if factory is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        close = difflib.get_close_matches(factory_name, names, n=3)
        hint = (f"; did you mean {', '.join(close)}?" if close else
                f"; callables defined there: {', '.join(sorted(names)) or 'none'}")
        raise CLIError(f"{path_text} has no factory {factory_name!r}{hint}")
    if not callable(factory):
        raise CLIError(f"{path_text}:{factory_name} is not callable")
    return module, factory


def build_model(module, factory, factory_args: dict[str, Any], spec: str):
    """Call the factory; return (model, example_inputs tuple, example_kwargs or None)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**factory_args)
        except TypeError as e:
            takes = ", ".join(sig.parameters) or "no arguments"
            raise CLIError(f"--factory-args do not fit {spec}: {e}; it takes {takes}") from None
    out = factory(**factory_args)
    kwargs = None
    if isinstance(out, nn.Module):
        model = out
        make_inputs = getattr(module, "example_inputs", None)
        if not callable(make_inputs):
            raise CLIError(f"{spec} returned only a model; return (model, example_inputs) or "
                           f"define example_inputs() in the file")
        inputs = make_inputs()
    elif isinstance(out, (tuple, list)) and len(out) in (2, 3) and isinstance(out[0], nn.Module):
        model, inputs = out[0], out[1]
        if len(out) == 3:
            kwargs = out[2]
            if not isinstance(kwargs, dict):
                raise CLIError(f"{spec} returned 3 items; the third must be a dict of "
                               f"example keyword inputs, got {type(kwargs).__name__}")
    else:
        raise CLIError(f"{spec} must return (model, example_inputs) or an nn.Module, got "
                       f"{type(out).__name__}")
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs), kwargs


def make_mesh(args):
    """The MeshSpec described by --mesh / --preset / --mesh-json."""
    if args.mesh_json:
        if args.preset is not None:
            raise CLIError("give either --preset or --mesh-json, not both")
        try:
            mesh = MeshSpec.from_json(args.mesh_json)
        except FileNotFoundError:
            raise CLIError(f"no such mesh file: {args.mesh_json}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CLIError(f"bad mesh file {args.mesh_json}: {e}") from None
        if args.mesh:
            try:
                mesh = mesh.with_shape(MeshSpec.parse_shape(args.mesh))
            except ValueError as e:
                raise CLIError(f"--mesh {args.mesh}: {e}") from None
        return mesh
    preset = args.preset or "cpu-gloo"
    if preset not in PRESET_NAMES:
        close = difflib.get_close_matches(preset, PRESET_NAMES, n=1)
        raise CLIError(f"unknown preset {preset!r}" + (f" (did you mean {close[0]!r}?)" if close
                                                       else "")
                       + f"; known presets: {', '.join(PRESET_NAMES)}")
    shape = None
    if getattr(args, "devices", None):  # autopar plan's (autopar check has none)
        if args.mesh:
            raise CLIError("give --mesh (a shape) or --devices (a count, its shape searched), not both")
        try:
            return MeshSpec.preset(preset, devices=device_counts(args.devices)[0])
        except ValueError as e:
            raise CLIError(f"--devices {args.devices} with --preset {preset}: {e}") from None
    if args.mesh:
        try:
            shape = MeshSpec.parse_shape(args.mesh)
        except ValueError:
            raise CLIError(f"bad --mesh {args.mesh!r}: expected a shape such as 8, 2x4 or "
                           f"2x2x2 (positive integers joined by 'x')") from None
    try:
        return MeshSpec.preset(preset, shape=shape)
    except ValueError as e:
        raise CLIError(f"--mesh {args.mesh} with --preset {preset}: {e}") from None


# ---------------------------------------------------------------- commands
def cmd_plan(args) -> int:
    """``autopar plan``: capture, search and print the plan."""

    mesh = make_mesh(args)
    if args.scaling and not args.devices:
        raise CLIError("--scaling draws a curve over several counts: give --devices 8,16,32,...")
    pins = parse_pins(args.pin)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    if args.time_limit is not None and args.time_limit <= 0:
        raise CLIError(f"--time-limit must be > 0, got {args.time_limit:g}")
    decisions = decision_options(args)
    fargs = {k: _literal(v) for k, v in parse_kv(args.factory_args, "--factory-args").items()}
    module, factory = load_factory(args.target)
    model, inputs, kwargs = build_model(module, factory, fargs, args.target)
    if args.devices and len(device_counts(args.devices)) > 1:
        return run_scaling(args, model, inputs, kwargs, device_counts(args.devices), mesh.name,
                           dict(pins=pins, memory_budget=budget, search=args.search, **decisions))

    t0 = time.perf_counter()
    try:
        p = make_plan(model, inputs, mesh, example_kwargs=kwargs, pins=pins,
                      memory_budget=budget, time_limit=args.time_limit or 30.0,
                      search=args.search, progress=progress_wanted(args), **decisions)
    except TimeoutError as e:  # the solver found no plan at all within its limit
        raise CLIError(f"{e} (--time-limit)") from e
    total = time.perf_counter() - t0

    if args.format == "tsv":  # greppable: the node rows and nothing else on stdout
        print(p.table(nodes=True, fmt="tsv", show_views=args.show_views))
    elif args.format == "json":
        print(p.to_json())
    else:
        print(p.summary())
        print()
        print(p.table(max_rows=args.max_rows, show_views=args.show_views, nodes=args.nodes))
        if args.collectives:
            print()
            print(format_collectives(p.collectives()))
        if not args.quiet:
            print(format_timings(p, total))
    for out, what in ((args.timeline, "timeline"), (args.trace, "trace")):
        if out:
            try:
                (timeline.draw_timeline if what == "timeline" else timeline.write_trace)(p, out)
            except OSError as e:
                raise CLIError(f"cannot write {out}: {e.strerror or e}") from None
            print(f"predicted {what} written to {out}", file=sys.stderr)
    if args.json:
        try:
            p.to_json(args.json)
        except OSError as e:
            raise CLIError(f"cannot write {args.json}: {e.strerror or e}") from None
        if args.format == "text":
            print(f"plan written to {args.json}")
    for name in args.explain:
        print()
        if name == _WHY:
            print(format_why(p))
            continue
        try:
            print(p.explain(name))
        except KeyError as e:
            raise CLIError(f"--explain {name}: {e.args[0]}") from None
    return 0


_WHY = "\0why"  # what a bare --explain appends: every decision's reason


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    ap = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization "
                                 "planner for PyTorch models.")

    v = versions()
    ap.add_argument("--version", action="version",
                    version=f"autopar {v['autopar_version']} (torch {v['torch_version']}, "
                            f"plan schema {v['schema_version']})")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan_parser(sub)

    add_parsers(sub)
    launch_parsers(sub)
    # cycle: autopar.cli.check imports this one
    from autopar.cli.check import add_parser as check_parser
    check_parser(sub)
    # cycle: autopar.cli.calibrate imports this one (through autopar.cli.check)
    from autopar.cli.calibrate import add_parser as calibrate_parser
    calibrate_parser(sub)
    return ap


def _add_plan_parser(sub: Any) -> None:
    """``autopar plan``: its inputs, the plan-level decisions it forces and its output."""
    p = sub.add_parser(
        "plan", help="plan a model and print the plan",
        description="Capture the model built by FACTORY, search data/tensor/ZeRO sharding "
                    "for the mesh and print the plan.",
        epilog="example: autopar plan examples/gpt.py:build --mesh 2x4 --preset 8xA100-nvlink")
    _plan_inputs(p)
    _decision_arguments(p.add_argument_group("plan-level decisions (searched unless given)"))
    _output_arguments(p.add_argument_group("output"))
    p.add_argument("--max-rows", type=int, default=None, help="truncate the node table")
    p.add_argument("--show-views", action="store_true",
                   help="also list free ops (views, getitems) in the table")
    p.set_defaults(func=cmd_plan)


def _plan_inputs(p: argparse.ArgumentParser) -> None:
    """What ``autopar plan`` plans: the model's factory, the mesh, pins and the search."""
    p.add_argument("target", metavar="FILE.py[:FACTORY]",
                   help="Python file and the factory in it (default: build) returning "
                        "(model, example_inputs), or a model if the file defines "
                        "example_inputs()")
    p.add_argument("--mesh", help="mesh shape, e.g. 8 or 2x4 (default: the preset's)")
    p.add_argument("--preset", help="hardware preset (default: cpu-gloo)")
    p.add_argument("--devices", metavar="N[,N...]",
                   help="a device count whose mesh shape is searched with the plan; several "
                   "(8,16,32) print a scaling curve: the best plan at each count, the example "
                   "batch being the first count's and the rows per device kept")
    p.add_argument("--scaling", metavar="OUT.png", help="with several --devices: draw the curve")
    p.add_argument("--mesh-json", help="mesh description written by MeshSpec.to_json "
                   "(--mesh then reshapes it)")
    p.add_argument("--json", metavar="OUT.json", help="write the plan as JSON")
    p.add_argument("--pin", action="append", default=[], metavar="NAME=PLACEMENTS",
                   help="fix a parameter/input/node placement, e.g. fc1.weight=S(0)R "
                        "(repeatable)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="bytes per device, e.g. 40GiB (default: the device's capacity less the preset's reserve)")
    p.add_argument("--search", choices=("auto", "ilp", "drec"), default="auto",
                   help="searcher: ilp (exact), drec (fast, one mesh axis per round) or auto "
                        "(the ILP when its problem fits the time limit; default)")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="SECONDS",
                   help="solver time limit (default 30)")
    p.add_argument("--factory-args", nargs="+", default=[], metavar="K=V",
                   help="keyword arguments for the factory (Python literals or strings)")
    p.add_argument("--explain", action="append", default=[], metavar="NAME", nargs="?",
                   const=_WHY,
                   help="also explain this node's or parameter's choice, or a decision "
                        "(pipeline, zero, micro_batches, recompute, a layer key such as "
                        "blocks.1); alone: why each decision was taken (repeatable)")


def _decision_arguments(d: Any) -> None:
    """The plan-level decisions ``autopar plan`` forces (searched unless given)."""
    d.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage over the data-parallel axis: 0 off, 1 optimizer state, "
                        "2 + gradients, 3 + parameters")
    d.add_argument("--zero-axes", type=int, nargs="+", default=None, metavar="AXIS",
                   help="the (stage) mesh axes ZeRO shards over: one (HSDP: the others "
                        "replicated) or several (one group spanning them)")
    d.add_argument("--pipeline-stages", type=int, default=None, metavar="N",
                   help="pipeline stages (each on a sub-mesh; N must divide a mesh axis)")
    d.add_argument("--pipeline-axis", type=int, default=None, metavar="AXIS",
                   help="the mesh axis the stages are carved from (0: the outermost, across "
                        "nodes; a later one: inside a node)")
    d.add_argument("--micro-batches", type=int, default=None, metavar="N",
                   help="micro-batches per step (gradient accumulation without a pipeline; "
                        "N must divide the batch)")
    d.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"), default=None,
                   help="pipeline schedule")
    d.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="model chunks per pipeline rank under --schedule interleaved-1f1b")
    d.add_argument("--recompute", action="append", default=None, metavar="LAYER[,LAYER...]",
                   help="layers whose activations are recomputed in backward, e.g. "
                        "blocks.0,blocks.1, or none (repeatable)")
    d.add_argument("--precision", choices=("native", "bf16-mixed", "fp16-mixed"), default="native",
                   help="bf16-mixed / fp16-mixed: compute as torch.autocast(bfloat16 / "
                        "float16) would, fp32 master weights; fp16 needs loss scaling "
                        "(pm.grad_scaler()) (default: the model's own dtypes)")
    d.add_argument("--batch", choices=("global", "local"), default="global",
                   help="local: each data-parallel rank passes its part of the batch and gets "
                        "its rows of batch-shaped outputs back, as with DDP")
    d.add_argument("--explore", action="store_true",
                   help="also try pipelines and micro-batches when the plain plan fits")


def _output_arguments(o: Any) -> None:
    """What ``autopar plan`` prints or writes besides the plan."""
    o.add_argument("--nodes", action="store_true",
                   help="one row per graph node instead of per layer (after the summary)")
    o.add_argument("--format", choices=("text", "tsv", "json"), default="text",
                   help="text (summary and tables, default), tsv (the node rows only, "
                        "tab-separated) or json (the plan)")
    o.add_argument("--timeline", metavar="OUT.png",
                   help="draw the predicted step per pipeline stage (compute, communication, "
                        "bubbles) as a PNG")
    o.add_argument("--trace", metavar="OUT.json",
                   help="write the predicted step as a Chrome/Perfetto trace (pm.trace records "
                        "the real one in the same format)")
    o.add_argument("--collectives", action="store_true",
                   help="list every collective one step issues per rank, with its bytes")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live search progress on stderr (default: on when stderr is a terminal)")
    o.add_argument("-q", "--quiet", action="store_true",
                   help="no progress and no timing line; warnings and errors only on stderr")
    o.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what autopar does (-v: phases, -vv: detail) on stderr")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autopar`` command; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:  # autopar launch ... -- train.py --its-options
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    try:
        args = ap.parse_args(argv)
        if command:
            args.command = command
    except SystemExit as e:  # --help, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else 2
    if getattr(args, "func", None) is None:
        ap.print_help(sys.stderr)
        return 2

    setup_logging(args)
    try:
        with cli_warnings():
            return args.func(args)
    except CLIError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    except AutoparError as e:
        print(f"autopar: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130

