"""Launch a training script the way its plan says: torchrun, SLURM or Kubernetes.

autopar does not ship a launcher: these commands generate what the existing engines
take, sized from the plan (its world size, and the devices per node of its preset)::

    autopar run --plan plan.json train.py --steps 100        # torchrun, this host
    autopar run --nnodes 2 --nproc-per-node 8 --rdzv-endpoint head:29500 train.py
    autopar launch --slurm plan.json -o job.sbatch -- train.py --steps 100
    autopar launch --k8s plan.json --image registry/train:1 -o job.yaml -- train.py

* ``run`` execs ``python -m torch.distributed.run`` (torchrun) with the c10d rendezvous
  (``--standalone`` on one node) after checking ``nnodes x nproc-per-node`` against the
  plan's world size, so a job that cannot run the plan fails before it starts.
* ``launch --slurm`` writes an sbatch script: one task per node, each running torchrun
  with the c10d rendezvous on the job's first node (``scontrol show hostnames``).
* ``launch --k8s`` writes a Kubeflow training-operator ``PyTorchJob`` (``kubeflow.org/v1``):
  a Master and ``N - 1`` Workers, ``nprocPerNode`` from the plan and a GPU limit per pod;
  the operator sets ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` ... which the
  container's ``torchrun`` reads.
* ``--elastic MIN``: the job runs on ``MIN`` to the plan's nodes and goes on when nodes
  are lost (torchrun ``--nnodes MIN:MAX`` with restarts; SLURM ``--nodes=MIN-MAX`` and
  ``--no-kill``; a PyTorchJob ``elasticPolicy`` over Workers).  The script must plan for
  the world it gets and resume from its last checkpoint (``autopar.load_checkpoint``,
  docs/tutorial.md section 7), not load a fixed plan.

A plan is a JSON file (``autopar plan --json``) or an export directory.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from autopar.cli.args import CLIError
from autopar.cli.tools import read_plan as read
from autopar.plans.roles import layout as layout_words

if TYPE_CHECKING:
    from autopar.plans.data import Plan


class LaunchError(Exception):
    """A launch request that cannot run the plan (printed by the CLI as an error)."""


@dataclass(frozen=True)
class Layout:
    """How many nodes and processes per node a job runs on."""

    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        """``nnodes * nproc_per_node``."""
        return self.nnodes * self.nproc_per_node


def layout_for(plan: Plan | None, nnodes: int | None = None,
               nproc_per_node: int | None = None) -> Layout:
    """The job's layout: what is given, the rest derived from the plan (its world size
    split into nodes of the preset's devices per node; one host for presets without
    nodes).  Raises :class:`LaunchError` when the result cannot run the plan."""
    for name, v in (("--nnodes", nnodes), ("--nproc-per-node", nproc_per_node)):
        if v is not None and v < 1:
            raise LaunchError(f"{name} must be >= 1, got {v}")
    if plan is None:
        if nproc_per_node is None:
            raise LaunchError("give --plan, or --nproc-per-node (and --nnodes for several nodes)")
        return Layout(nnodes or 1, nproc_per_node)
    world = plan.world_size
    gpn = plan.mesh.gpus_per_node
    if nnodes is None and nproc_per_node is None:
        per = gpn if gpn and world > gpn and world % gpn == 0 else world
        nnodes, nproc_per_node = world // per, per
    elif nnodes is None:
        if world % nproc_per_node:
            raise LaunchError(f"the plan runs on {world} ranks, which --nproc-per-node "
                              f"{nproc_per_node} does not divide into whole nodes")
        nnodes = world // nproc_per_node
    elif nproc_per_node is None:
        if world % nnodes:
            raise LaunchError(f"the plan runs on {world} ranks, which {nnodes} nodes cannot "
                              "share evenly")
        nproc_per_node = world // nnodes
    out = Layout(nnodes, nproc_per_node)
    if out.world_size != world:
        raise LaunchError(f"--nnodes {nnodes} x --nproc-per-node {nproc_per_node} = "
                          f"{out.world_size} ranks, but the plan was made for {world} "
                          f"(mesh {'x'.join(map(str, plan.request.mesh_shape or plan.mesh.shape))}): "
                          "launch that many ranks, or re-plan for this world size")
    return out


def read_plan(path: str | Path) -> Plan:
    """A plan from a JSON file or an export directory."""
    return read(str(path))


def torchrun_argv(layout: Layout, script: str, args: list[str] = (), *, rdzv_endpoint: str | None = None,
                  rdzv_id: str = "autopar", python: str | None = None) -> list[str]:
    """The torchrun command line (as a list) for ``script args`` on ``layout``."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if layout.nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone", "--nproc-per-node", str(layout.nproc_per_node)]
    else:
        if rdzv_endpoint is None:
            raise LaunchError(f"{layout.nnodes} nodes need --rdzv-endpoint HOST:PORT (a host "
                              "every node can reach, e.g. the first node)")
        cmd += ["--nnodes", str(layout.nnodes), "--nproc-per-node", str(layout.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return cmd + [script, *args]


def run(argv: list[str]) -> int:
    """Run ``argv`` as a child, forwarding SIGTERM and SIGINT to it (schedulers stop
    jobs with SIGTERM; torchrun then stops its workers); returns its exit status."""
    child = subprocess.Popen(argv)

    def forward(sig, _frame) -> None:
        child.send_signal(sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _source(plan_path: str | Path | None) -> str:
    return f" from {plan_path}" if plan_path else ""


def slurm_script(plan: Plan, script: str, args: list[str] = (), *, layout: Layout | None = None,
                 job_name: str = "autopar", partition: str | None = None, time: str | None = None,
                 gpus_per_node: int | None = None, port: int = 29500, setup: list[str] = (),
                 python: str = "python3", plan_path: str | None = None,
                 elastic: int | None = None) -> str:
    """An sbatch script running ``script args`` under torchrun on every node of
    ``layout`` (default: :func:`layout_for` the plan); ``elastic``: the fewest nodes it
    may run on and go on with (module docstring)."""
    for what, v in (("job name", job_name), ("partition", partition), ("time", time)):
        # sbatch reads #SBATCH lines itself (no shell quoting): a space or a newline would
        # cut the option or inject another line
        if v is not None and (not v or any(c.isspace() or c in "#'\"\\" for c in v)):
            raise LaunchError(f"{what} {v!r} cannot go on an #SBATCH line (no spaces, quotes or #)")
    lay = layout or layout_for(plan)
    low = _elastic_min(elastic, lay)
    gpus = plan.mesh.gpus_per_node and lay.nproc_per_node if gpus_per_node is None else gpus_per_node
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={lay.nnodes if low is None else f'{low}-{lay.nnodes}'}",
             "#SBATCH --ntasks-per-node=1"]
    if low is not None:
        lines.append("#SBATCH --no-kill")  # a failed node leaves the others running
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    nnodes = ["--nnodes", "$SLURM_NNODES"] if low is None else \
        ["--nnodes", f"{low}:$SLURM_NNODES", "--max-restarts", str(_RESTARTS)]
    cmd = [python, "-m", "torch.distributed.run", *nnodes,
           "--nproc-per-node", str(lay.nproc_per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "$HEAD:$PORT", "--rdzv-id", "$SLURM_JOB_ID", script, *args]
    quoted = " ".join(f'"{c}"' if "$" in c else shlex.quote(c) for c in cmd)
    if low is None:
        check = [f'if [ "$SLURM_NNODES" -ne {lay.nnodes} ]; then',
                 f'  echo "autopar: the plan needs {lay.nnodes} nodes, this job has $SLURM_NNODES" >&2']
    else:
        check = [f'if [ "$SLURM_NNODES" -lt {low} ] || [ "$SLURM_NNODES" -gt {lay.nnodes} ]; then',
                 f'  echo "autopar: the job runs on {low} to {lay.nnodes} nodes, this one has '
                 '$SLURM_NNODES" >&2']
    lines += [f"# generated by autopar{_source(plan_path)}: {layout_words(plan)}",
              f"# {lay.nnodes} node(s) x {lay.nproc_per_node} process(es) = {lay.world_size} ranks",
              "set -euo pipefail",
              *setup,
              "if command -v scontrol >/dev/null 2>&1; then",
              '  HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "else  # no scontrol (a test outside SLURM): the node list is the head's address",
              '  HEAD=${SLURM_JOB_NODELIST%%,*}',
              "fi",
              f"PORT=${{AUTOPAR_RDZV_PORT:-{port}}}",
              *check,
              "  exit 2",
              "fi",
              f"srun --ntasks-per-node=1 {quoted}", ""]
    return "\n".join(lines)


def pytorchjob(plan: Plan, script: str, args: list[str] = (), *, image: str, name: str = "autopar",
               namespace: str | None = None, layout: Layout | None = None,
               gpus_per_node: int | None = None, plan_path: str | None = None,
               elastic: int | None = None) -> dict:
    """A Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``) for ``script args``: one pod per
    node, ``nprocPerNode`` ranks each; ``elastic``: Workers only, from that many up to the
    plan's nodes (module docstring)."""
    if not image:
        raise LaunchError("--image is required: the container image with your code, torch and autopar")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        raise LaunchError(f"job name {name!r} is not a Kubernetes name (lower-case letters, digits "
                          "and '-', at most 63)")
    lay = layout or layout_for(plan)
    low = _elastic_min(elastic, lay)
    gpus = plan.mesh.gpus_per_node and lay.nproc_per_node if gpus_per_node is None else gpus_per_node

    def replica(n: int) -> dict:
        container = {"name": "pytorch", "image": image,
                     # the operator sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT and
                     # PET_NPROC_PER_NODE, which torchrun reads as its defaults
                     "command": ["torchrun", script, *args]}
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        return {"replicas": n, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container]}}}

    meta = {"name": name, "labels": {"app.kubernetes.io/created-by": "autopar"}}
    if namespace:
        meta["namespace"] = namespace
    spec: dict = {"nprocPerNode": str(lay.nproc_per_node)}
    if low is None:
        specs = {"Master": replica(1)}
        if lay.nnodes > 1:
            specs["Worker"] = replica(lay.nnodes - 1)
    else:  # the operator's elastic mode: Workers only, rendezvous over c10d
        specs = {"Worker": replica(lay.nnodes)}
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": low, "maxReplicas": lay.nnodes,
                                 "maxRestarts": _RESTARTS}
    spec.update(pytorchReplicaSpecs=specs, runPolicy={"cleanPodPolicy": "None"})
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta, "spec": spec}


_RESTARTS = 3  # an elastic job's restarts (a lost node each) before it fails


def _elastic_min(elastic: int | None, lay: Layout) -> int | None:
    """``--elastic``'s fewest nodes, checked against the job's."""
    if elastic is not None and not 1 <= elastic <= lay.nnodes:
        raise LaunchError(f"--elastic {elastic}: the fewest nodes must be 1 to the job's {lay.nnodes}")
    return elastic


def pytorchjob_yaml(job: dict, comment: str = "") -> str:
    """``job`` as YAML (PyYAML), with an optional leading comment.  Every string is
    double-quoted: PyYAML follows YAML 1.1 and leaves ``1e-3`` or ``0x10`` bare, which
    Kubernetes' YAML 1.2 parser reads as numbers, and a number in ``command`` (a list of
    strings) is rejected by the API server."""
    class Quoted(yaml.SafeDumper):
        pass

    Quoted.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style='"'))
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    return head + yaml.dump(job, Dumper=Quoted, sort_keys=False)


# ---------------------------------------------------------------- CLI
def _error(e: Exception):
    return CLIError(str(e))


def cmd_run(args) -> int:
    """``autopar run``."""
    try:
        plan = read_plan(args.plan) if args.plan else None
        lay = layout_for(plan, args.nnodes, args.nproc_per_node)
        argv = torchrun_argv(lay, args.script, args.args, rdzv_endpoint=args.rdzv_endpoint,
                             rdzv_id=args.rdzv_id)
    except LaunchError as e:
        raise _error(e) from None
    print("autopar run: " + shlex.join(argv), file=sys.stderr, flush=True)
    return run(argv)


def cmd_launch(args) -> int:
    """``autopar launch --slurm|--k8s``."""
    rest = list(args.command)
    if not rest:
        raise _error(LaunchError("give the training command after --, e.g. -- train.py --steps 100"))
    script, sargs = rest[0], rest[1:]
    try:
        plan = read_plan(args.plan)
        lay = layout_for(plan, args.nnodes, args.nproc_per_node)
        if args.slurm:
            text = slurm_script(plan, script, sargs, layout=lay, job_name=args.name,
                                partition=args.partition, time=args.time,
                                gpus_per_node=args.gpus_per_node, setup=args.setup,
                                python=args.python, plan_path=args.plan, elastic=args.elastic)
        else:
            job = pytorchjob(plan, script, sargs, image=args.image or "", name=args.name,
                             namespace=args.namespace, layout=lay,
                             gpus_per_node=args.gpus_per_node, plan_path=args.plan, elastic=args.elastic)
            text = pytorchjob_yaml(job, f"generated by autopar{_source(args.plan)}: "
                                        f"{lay.nnodes} node(s) x {lay.nproc_per_node} ranks")
    except LaunchError as e:
        raise _error(e) from None
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({lay.nnodes} node(s) x {lay.nproc_per_node})", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def add_parsers(sub) -> None:
    """Register ``run`` and ``launch`` on the CLI's subparsers."""
    p = sub.add_parser("run", help="run a script under torchrun, sized and checked by the plan",
                       description="Run SCRIPT under torchrun (torch.distributed.run). With "
                                   "--plan, the world size must equal the plan's and the "
                                   "missing sizes are derived from it.",
                       epilog="example: autopar run --plan plan.json train.py --steps 100")
    p.add_argument("--plan", help="plan JSON or export directory to size and check the job")
    p.add_argument("--nnodes", type=int, help="nodes (default: from the plan, else 1)")
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: from the plan)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="c10d rendezvous endpoint (needed for several nodes)")
    p.add_argument("--rdzv-id", default="autopar", help="rendezvous id (same on every node)")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("launch", help="write a SLURM sbatch script or a Kubernetes PyTorchJob",
                       description="Write what a cluster scheduler takes to run a training "
                                   "command as the plan says: --slurm an sbatch script "
                                   "(srun + torchrun), --k8s a Kubeflow PyTorchJob.",
                       epilog="example: autopar launch --slurm plan.json -o job.sbatch -- "
                              "train.py --steps 100")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--slurm", action="store_true", help="an sbatch script")
    kind.add_argument("--k8s", action="store_true", help="a Kubeflow PyTorchJob YAML")
    p.add_argument("plan", metavar="PLAN", help="plan JSON or export directory")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    p.add_argument("--name", default="autopar", help="job name")
    p.add_argument("--nnodes", type=int, help="nodes (default: from the plan)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: from the plan)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs to request per node (default: the ranks per node on GPU presets)")
    p.add_argument("--elastic", type=int, metavar="MIN",
                   help="run on MIN to the plan's nodes and go on when nodes are lost (the "
                        "script re-plans and resumes: autopar.load_checkpoint)")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--time", help="SLURM time limit, e.g. 04:00:00")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="shell line run before srun, e.g. 'source .venv/bin/activate' (repeatable)")
    p.add_argument("--python", default="python3", help="python on the nodes (SLURM)")
    p.add_argument("--image", help="container image (Kubernetes; required)")
    p.add_argument("--namespace", help="Kubernetes namespace")
    # the training command follows "--"; autopar.cli.main splits it off before parsing
    # (argparse cannot take options between a positional and a trailing list)
    p.set_defaults(func=cmd_launch, command=[])


__all__ = ["Layout", "LaunchError", "add_parsers", "cmd_launch", "cmd_run", "layout_for",
           "pytorchjob", "pytorchjob_yaml", "read_plan", "run", "slurm_script", "torchrun_argv"]
