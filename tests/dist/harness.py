"""Real multi-process gloo harness: one process group per test module, many cases.

``run_cases(world, cases)`` spawns ``world`` ranks once; each rank runs every case
(plan, shard, train) and rank 0 returns a result dict per case.  Each case compares
the parallel module against the single-process model on the same global batch.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Case:
    """One scenario: a model factory, a mesh and pins (empty = planner's choice)."""

    id: str
    model: str  # module in examples/
    mesh: tuple[int, ...]
    pins: dict = field(default_factory=dict)
    build_kwargs: dict = field(default_factory=dict)
    steps_adam: int = 2
    search: str = "ilp"  # the searcher that makes the plan: "ilp", "drec" or "auto"
    options: dict = field(default_factory=dict)  # forced decisions: zero_stage, micro_batches, ...
    measure_memory: bool = False


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_err(a: dict, b: dict, keys) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k in keys:
        e = (a[k].float() - b[k].float()).abs().max().item()
        if e > worst:
            worst, where = e, k
    return worst, where


def _dynamo_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def run_case(case: Case) -> dict:
    """Plan, shard and train ``case`` on this rank; compare with the reference."""
    from autopar import MeshSpec, auto_parallel
    from autopar.runtime.mesh import reset

    made = _dynamo_graphs()
    mod = importlib.import_module(case.model)
    model, ex = mod.build(**case.build_kwargs)
    ref = copy.deepcopy(model)
    mesh = MeshSpec.preset("cpu-gloo", shape=case.mesh)
    reset()
    pm = auto_parallel(model, example_inputs=ex, mesh=mesh, pins=case.pins, search=case.search,
                       **case.options)
    d = pm.plan.decisions
    res: dict = {"plan_params": pm.plan.params(), "collectives": len(pm.plan.redistributions()),
                 # what the generated forward calls (collectives, local op forms)
                 "calls": sorted({getattr(n.target, "__name__", str(n.target))
                                  for n in pm.inner.graph.nodes if n.op == "call_function"}),
                 "searcher": pm.plan.solver.searcher, "compiled": pm.compiled,
                 "decisions": {"zero": d.zero_stage, "stages": d.pipeline_stages,
                               "pipeline_axis": d.pipeline_axis, "schedule": d.schedule,
                               "virtual_stages": d.virtual_stages, "micro_batches": d.micro_batches, "recompute": d.recompute,
                               "zero_kept": list(d.zero_kept), "zero_reduce_once": d.zero_reduce_once,
                               "gather_chunks": [list(c) for c in d.gather_chunks],
                               "precision": d.precision, "zero_axes": list(d.zero_axes),
                               "memory": {k: float(v) for k, v in pm.plan.memory.items()}}}
    names = [n for n, _ in ref.named_parameters()]
    # 1. loss and every gradient
    loss = pm.train_step(*ex)  # forward + backward (all micro-batches / pipeline stages)
    rl = ref(*ex)
    rl.backward()
    res["loss"], res["ref_loss"] = loss.item(), rl.item()
    graphs = _dynamo_graphs()
    grads = pm.full_grads()
    res["grad_err"], res["grad_worst"] = _max_err(grads, {n: p.grad for n, p in ref.named_parameters()}, names)
    res["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters())
    # 2. two SGD steps with momentum (the second one uses the momentum buffer, which
    # under ZeRO lives only for this rank's shard)
    sgd = torch.optim.SGD(pm.parameters(), lr=0.02, momentum=0.9)
    rsgd = torch.optim.SGD(ref.parameters(), lr=0.02, momentum=0.9)
    _step_both(pm, ref, ex, sgd, rsgd, fresh_grads=False)  # the gradients of step 1
    _step_both(pm, ref, ex, sgd, rsgd)
    full = pm.full_state_dict()
    rsd = ref.state_dict()
    res["sgd_err"], res["sgd_worst"] = _max_err(full, rsd, names)
    # 3. two AdamW steps
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(case.steps_adam):
        _step_both(pm, ref, ex, opt, ropt)
    full = pm.full_state_dict()
    res["adam_err"], res["adam_worst"] = _max_err(full, ref.state_dict(), names)
    res["state_keys_match"] = sorted(full) == sorted(ref.state_dict())
    # graphs dynamo made after the first step (a recompile per step would add some)
    res["dynamo_recompiled"] = _dynamo_graphs() - graphs
    res["dynamo_graphs"] = _dynamo_graphs() - made  # none where dynamo gave up on the graph
    res["compiled"] = pm.compiled  # after the steps: False where a compile fell back to eager
    if case.measure_memory:
        res["memory"] = _measure_memory(pm, opt, ex)
    return res


def _step_both(pm, ref, ex, opt, ropt, fresh_grads: bool = True) -> None:
    """One optimizer step on the parallel module and the reference alike; with
    ``fresh_grads`` both first recompute their gradients on ``ex``."""
    if fresh_grads:
        opt.zero_grad()
        ropt.zero_grad()
        pm.train_step(*ex)
        ref(*ex).backward()
    opt.step()
    ropt.step()


def _measure_memory(pm, opt, ex) -> list[dict]:
    """Every rank's measured peak tensor bytes over one training step (parameters,
    optimizer state, gradients and activations; autopar.runtime.memstats) next to the
    plan's prediction for its pipeline stage."""
    from autopar.runtime.memstats import module_state_bytes, peak_bytes

    opt.zero_grad()
    peak = peak_bytes(lambda: pm.train_step(*ex), baseline=module_state_bytes(pm, opt))
    d = pm.plan.decisions
    stage = pm._mesh_rt.stage
    predicted = d.stage_memory[stage] if d.stage_memory else pm.plan.memory["total"]
    mine = {"rank": dist.get_rank(), "stage": stage, "measured": peak, "predicted": predicted}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


# every torch.distributed call the runtime issues collectives through; isend and irecv
# stay as they are (P2POp accepts only the originals): batch_isend_irecv is watched
_SPIED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "broadcast",
          "send", "recv", "batch_isend_irecv", "barrier")


def _spy_thread_state(seen: list[str]) -> None:
    """Wrap the collectives of ``torch.distributed`` so that each call issued with a
    Python object in the thread's state (autopar/runtime/tls.py: such a work can abort
    the process at exit) appends ``"name: what"`` to ``seen``."""
    import functools

    from autopar.runtime.tls import python_state

    def wrap(name: str, fn):
        @functools.wraps(fn)
        def spied(*args, **kwargs):
            state = python_state()
            if state:
                seen.append(f"{name}: {', '.join(state)}")
            return fn(*args, **kwargs)
        return spied

    for name in _SPIED:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _no_thread_state_leaks(results: dict[str, dict]) -> dict[str, dict]:
    """``results`` as they are, unless a case issued a collective with Python objects
    in its thread state (then AssertionError naming the cases and collectives)."""
    leaks = {k: r["thread_state_leaks"] for k, r in results.items()
             if isinstance(r, dict) and r.get("thread_state_leaks")}
    assert not leaks, f"collectives issued with Python objects in thread-local state: {leaks}"
    return results


def _resolve(fn: str):
    """The function named ``"module:function"``."""
    mod, name = fn.split(":")
    return getattr(importlib.import_module(mod), name)


def _worker(rank: int, world: int, port: int, cases: list[dict], out: str,
            fn: str | None = None, group_timeout: float = 180.0) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), HF_HUB_OFFLINE="1")
    sys.path.insert(0, str(ROOT / "examples"))
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    seen: list[str] = []
    _spy_thread_state(seen)  # imports autopar before the group is made, as a script would
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout))
    results = {}
    for c in cases:
        seen.clear()
        try:
            if fn is not None:
                results[c["id"]] = _resolve(fn)(c)
            else:
                case = Case(**{**c, "mesh": tuple(c["mesh"])})
                results[case.id] = run_case(case)
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[c["id"]] = {"error": traceback.format_exc()}
            if os.environ.get("AUTOPAR_DEBUG_RANKS"):
                print(f"rank {rank}:", results[c["id"]]["error"], file=sys.stderr)
            break  # ranks may now disagree on collectives: stop rather than hang
        if isinstance(results[c["id"]], dict) and seen:
            results[c["id"]]["thread_state_leaks"] = sorted(set(seen))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    if dist.is_initialized():  # a case may end with pm.shutdown()
        dist.destroy_process_group()
    # leave without running C++ static destructors: a rank whose library threads were
    # still being torn down at interpreter exit was seen to abort ("terminate called
    # without an active exception") after its work was done and reported
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks start from a fork server that imported these once for the whole test session:
# a spawned rank imported torch and autopar itself, 4 s of CPU on the 2-core hosts,
# 8-16 s of a 4-rank module's wall time.  A rank is still a fresh process: the server
# ran nothing but these imports (no process group, no model), so each rank forks from
# that and makes its own group, as a spawned one did.
# imported once by the forkserver, so every rank forked from it has them: transformers
# and the modelling modules the HF cases build cost a rank ~4 s of CPU to import (14
# ranks of the default suite build an HF model).  The second half are what a rank
# imports lazily on its first plan, export and pipeline (torch.export's tracer, the
# partitioner and its networkx, OR-Tools, autopar's search, passes and runtime): ~1 s
# of CPU a rank, listed from the modules a default-suite rank had at its end
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "autopar",
            "tests.dist.harness", "transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.mixtral.modeling_mixtral",
            "torch.export._trace", "torch.export._unlift", "torch._functorch.aot_autograd",
            "torch._functorch.partitioners", "torch.distributed.pipelining",
            "ortools.sat.python.cp_model", "ortools.linear_solver.python.model_builder_helper",
            "autopar.search.joint", "autopar.passes.lower", "autopar.passes.split_stages",
            "autopar.module.export", "autopar.validate", "autopar.runtime.pipeline",
            "autopar.runtime.zero3", "autopar.runtime.ring_attention",
            "autopar.runtime.local_step", "autopar.runtime.memstats", "autopar.runtime.agree",
            "autopar.runtime.dparams", "autopar.runtime.zero", "autopar.runtime.call_check",
            "autopar.plans.json", "autopar.passes.device",
            *(f"autopar.sharding.rules.{m}" for m in (
                "conv", "embedding", "losses", "matmul", "moe", "norms", "pointwise",
                "reductions", "views"))]


def forkserver() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes fork from the server that imported
    :data:`_PRELOAD` (started on first use, one per test process)."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return multiprocessing.get_context("forkserver")


def _start(args: tuple, world: int) -> None:
    forkserver()
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="forkserver")


def run_cases(world: int, cases: list[Case]) -> dict[str, dict]:
    """Start ``world`` gloo ranks once, run every case, return rank 0's results."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        _start((world, free_port(), [asdict(c) for c in cases], out), world)
        return _no_thread_state_leaks(json.loads(Path(out).read_text()))


def run_fn_cases(world: int, fn: str, cases: list[dict],
                 group_timeout: float = 180.0) -> dict[str, dict]:
    """Like :func:`run_cases`, but every rank calls ``fn`` (``"module:function"``) on
    each case dict (which has an ``"id"``); rank 0's return values come back.
    ``group_timeout``: the process group's own timeout (seconds), as a user's
    ``init_process_group(timeout=...)`` sets it."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        _start((world, free_port(), cases, out, fn, group_timeout), world)
        return _no_thread_state_leaks(json.loads(Path(out).read_text()))
