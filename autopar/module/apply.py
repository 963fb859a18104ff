"""How a plan is applied to its module: one function per decision, each called where
its decision asks for it, in this fixed order (torchtitan's ``apply_*`` habit), with what
it reads and makes in the call:

1. :func:`apply_inputs`: who passes which samples (decision ``batch``), and
   :func:`apply_packing`: the rows a padded call is packed into (decision ``pack``), as
   the module is built (a planning-only one too); then :func:`apply_plan`, under a process group,
   checks the plan (:func:`~autopar.module.plan_checks.check_plan`: decisions that cannot
   run together) and applies the rest:
2. :func:`apply_device`: weights, buffers and the graph's constants on the rank's device;
3. :func:`apply_zero`: ZeRO 1/2/3 (decisions ``zero``, ``zero_kept``, ``zero_reduce_once``,
   ``gather_chunks``), then :func:`apply_offload`: ZeRO-3's shards in host memory
   (decision ``offload``; the optimizer level is applied with the DTensor parameters,
   step 7);
4. :func:`apply_recompute`: recomputed layers (decision ``recompute``);
5. :func:`apply_copies`: the micro-batches as copies interleaved in one graph (decision
   ``copies``), or else :func:`apply_pipeline`: pipeline stages and micro-batches, run
   by the schedule's runner (decisions ``pipeline``, ``micro_batches``);
6. :func:`apply_grad_sync`: gradient buckets (decisions ``grad_buckets``, ``grad_buffers``);
7. :func:`apply_dparams`: parameters as DTensors under the original names, and
   :func:`apply_unused`: the tensors the forward never reads;
8. :func:`apply_checks`: the dropout generator and the first call's agreement check;
9. :func:`apply_compile`: the graph through ``torch.compile`` (decision ``compile``).

Decisions that shape the graph itself are applied before the module exists: precision
at capture (:func:`autopar.capture.mixed_precision.apply_mixed_precision`), placements and
context parallelism in lowering (:mod:`autopar.passes`).  Each function that applies a
decision is registered for it where it is defined (``@applies(...)``, the registry's
:attr:`~autopar.plans.decisions.Decision.apply`), and ``tests/unit/test_decisions.py``
checks that every decision's is a step called here (or at capture or lowering).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn
from torch.distributed.tensor import Replicate

from autopar.log import log
from autopar.module.loop import LoopHabits, move_to_device
from autopar.module.plan_checks import check_plan, zero_axes_in_use
from autopar.module.runners import Switches, keep_loss_only, stage_runner
from autopar.module.shapes import Route, ShapeRoutes
from autopar.module.state import TensorInfo
from autopar.passes.device import set_device
from autopar.passes.multi_copy import multi_copy
from autopar.passes.recompute import recompute
from autopar.plans.data import Plan
from autopar.plans.decisions import applies
from autopar.runtime import local_step
from autopar.runtime.dparams import DParams, Entry, as_dtensor, register_tree
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.inputs import BatchMode, InputBinder, data_parallel_axes, passthrough_inputs
from autopar.runtime.mesh import RuntimeMesh
from autopar.runtime.packing import global_rows
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.zero import Zero
from autopar.runtime.zero_layout import check as check_layout
from autopar.runtime.zero_layout import placements as zero_placements

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule


# attribute names of ParallelModule itself: a model's top-level submodule or parameter
# of the same name could not be registered under its own name
_RESERVED = frozenset({"inner", "plan", "aliases", "state_keys", "rank", "runner", "zero", "rng",
                       "grad_sync", "lowered_graph", "code", "binder", "info", "training",
                       "routes", "generate"})

Tensors = list[tuple[str, torch.Tensor | None]]
"""(graph target, tensor) for every parameter and buffer of the graph, ``None`` for a
ZeRO-3 parameter, which exists only as a shard (:meth:`~autopar.module.parts.Parts.targets`)."""


@dataclass(frozen=True)
class StepContext:
    """What the steps share, read from the module once before them (graph targets
    throughout): the plan, this rank's mesh and the tensors of its pipeline stage."""

    plan: Plan
    mesh: RuntimeMesh
    mine: frozenset[str]
    """The targets this rank's pipeline stage holds."""
    aliases: Mapping[str, list[str]]
    """Target -> the original model's names for it (tied weights: several)."""
    placements: Mapping[str, tuple]
    """Parameter -> the plan's placements."""
    replicated: Mapping[str, tuple[int, ...]]
    """Parameter -> its replicated mesh axes of more than one device."""
    shapes: Mapping[str, tuple[int, ...]]
    """Target -> its whole shape, as planned."""
    frozen: frozenset[str]
    """The targets of frozen parameters."""
    info: TensorInfo

    @classmethod
    def of(cls, pm: ParallelModule) -> StepContext:
        """``pm``'s plan and stage, as the steps read them."""
        p = pm._parts
        return cls(p.plan, p.mesh, frozenset(t for t in p.aliases if p.mine(t)),
                   p.aliases, p.placements, {t: p.replicated_axes(t) for t in p.placements},
                   {t: tuple(n.shape[0]) for t, n in pm._param_nodes.items()},
                   frozenset(t for t in p.aliases if p.frozen(t)), p.info)


def apply_plan(pm: ParallelModule, full_state: Mapping[str, torch.Tensor] | None) -> None:
    """Check ``pm.plan`` (:func:`~autopar.module.plan_checks.check_plan`), then apply each of its runtime decisions
    to ``pm``, in the module docstring's order (under a process group; a planning-only
    module gets :func:`apply_inputs` only)."""
    ctx = StepContext.of(pm)
    d = pm.plan.decisions
    check_plan(pm.plan, frozen=ctx.frozen)
    apply_device(pm.inner, pm._parts.targets(), ctx)
    z = zero_axes_in_use(pm.plan)
    if z:
        pm.zero = apply_zero(pm.inner, pm._parts.targets(), z, ctx)
    if d.offload == "params":  # under ZeRO-3 (check_plan)
        apply_offload(pm.zero, ctx.mesh)
    if d.recompute:
        apply_recompute(pm.inner, d.recompute)
    if d.copies > 1 and d.micro_batches > 1:  # as many as the copies, one stage (check_plan)
        object.__setattr__(pm, "inner", apply_copies(pm.inner, d.copies, pm._out_spec))  # not a submodule
    elif d.pipeline_stages > 1 or d.micro_batches > 1:
        pm.runner = apply_pipeline(pm.inner, ctx, Switches(pm), pm._out_spec)
    pm.grad_sync = apply_grad_sync(pm._parts.targets(), ctx, pm.zero)
    pm._dparams = apply_dparams(pm, pm._parts.targets(), ctx, pm.zero, pm.grad_sync)
    pm._entry = {e.target: e for e in pm._dparams.entries}
    pm._extra = apply_unused(pm, full_state, ctx)
    apply_checks(pm._habits)
    if d.compile:
        apply_compile(pm)


@applies("compile")
def apply_compile(pm: ParallelModule) -> None:
    """Run the generated graph through ``torch.compile`` (decision ``compile``:
    :meth:`ParallelModule.compile`; a compile that fails runs eagerly, with a warning)."""
    pm.compile()
    if not pm.compiled:
        log.info("compiled: the zero-bubble schedule's stages run eagerly")


@applies("batch")
def apply_inputs(pm: ParallelModule, binder: InputBinder, batch: BatchMode | str) -> None:
    """Who passes which samples (decision ``batch``): the binder of calls to the graph's
    flat inputs, its data-parallel axes and the inputs taken as this rank's rows."""
    binder.mode = BatchMode(batch)
    binder.dp_axes = data_parallel_axes(pm.plan)
    # the flat inputs the lowered graph takes as this rank's rows (passes/lower.py
    # skips their slice; placeholders keep their names through export and load)
    keep = passthrough_inputs(pm.plan)
    graph = getattr(pm.inner, "graph", None)
    binder.passthrough = frozenset(
        i for i, n in enumerate(x for x in graph.nodes if x.op == "placeholder")
        if n.name in keep) if graph is not None else frozenset()
    pm.binder = binder
    # other shapes than the planned one: a lowering of this plan per shape
    # (autopar.module.shapes), for a module that runs (a loaded export has no model to
    # capture again: ShapeRoutes says so when asked)
    pm.routes = ShapeRoutes(Route(None, list(binder.shapes), binder.passthrough))
    pm._route = pm.routes.planned
    binder.select = pm._select_route if pm._mesh_rt is not None else None


@applies("pack")
def apply_packing(plan: Plan) -> int | None:
    """Under ``pack=True`` (:mod:`autopar.runtime.packing`) the rows a call's right-padded
    batch is packed into: the whole batch into one per device and micro-batch, or under
    ``batch="local"`` a rank's own part into one per micro-batch; ``None``: calls run
    as given."""
    d = plan.decisions
    if not d.pack:
        return None
    return d.micro_batches if d.batch == BatchMode.LOCAL else global_rows(plan.mesh.shape, d.micro_batches)


def apply_device(gm: nn.Module, tensors: Tensors, ctx: StepContext) -> None:
    """One device per process (cuda:LOCAL_RANK under NCCL): weights, buffers and the
    graph's constants move there before anything views them; frozen parameters stay so."""
    move_to_device(gm, ctx.mesh.device)  # parameters in place: ``tensors`` still hold them
    set_device([m for m in gm.modules() if isinstance(m, fx.GraphModule)], ctx.mesh.device)
    for t, p in tensors:  # also for modules loaded from an export
        if isinstance(p, nn.Parameter) and t in ctx.frozen:
            p.requires_grad_(False)


@applies("zero", "zero_kept", "zero_reduce_once", "gather_chunks")
def apply_zero(gm: fx.GraphModule, tensors: Tensors, z: tuple[int, ...], ctx: StepContext) -> Zero:
    """ZeRO over the mesh axes ``z`` (decisions ``zero``, ``zero_kept``,
    ``zero_reduce_once``, ``gather_chunks``): replicated parameters sharded over them,
    their optimizer state (1), gradients (2) and parameters (3, gathered per layer, the
    kept layers left gathered); stages 1-2 gather the updated parameters in the plan's
    chunks."""
    d = ctx.plan.decisions
    params = []
    for t, p in tensors:
        rep = ctx.replicated.get(t)
        # a parameter replicated on every ZeRO axis (one sharded on some of them by
        # the plan keeps its placement and its gradient sync; so does a 0-d one:
        # Shard(0) has no dim to cut)
        if t in ctx.mine and rep is not None and isinstance(p, nn.Parameter) and p.requires_grad \
                and p.dim() > 0 and set(z) <= set(rep):
            params.append((t, tuple(a for a in rep if a not in z)))
    layers = {n.param: n.layer for n in ctx.plan.nodes.values() if n.param and n.layer}
    return Zero.install(gm, params, d.zero_stage, z, layers, frozenset(d.zero_kept), d.gather_chunks)


@applies("offload")
def apply_offload(zero: Zero, mesh: RuntimeMesh) -> None:
    """Host memory (decision ``offload``).  ``"params"``: ZeRO-3's shards move there
    (pinned on CUDA, so the gathers copy them up asynchronously), before the DTensor
    parameters view them, so the optimizer steps them where they are.  ``"optimizer"``:
    :func:`apply_dparams` gives each DTensor parameter a host copy to step
    (:class:`~autopar.runtime.dparams.DParams`)."""
    r = mesh.coord_of(zero.axes)
    for zp in zero.params:
        zp.flat.data = to_host(zp.flat.data)
        zp.shard.data = zp.cut.view(zp.flat, r)  # the parameter still views what is sent


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (pinned when CUDA is there, for asynchronous copies); a CPU
    tensor as it is."""
    if t.device.type == "cpu":
        return t
    return t.to("cpu").pin_memory() if torch.cuda.is_available() else t.to("cpu")


@applies("recompute")
def apply_recompute(gm: fx.GraphModule, layers: list[str]) -> None:
    """Recompute ``layers`` in backward (decision ``recompute``)."""
    recompute(gm, set(layers))


@applies("copies")
def apply_copies(gm: fx.GraphModule, copies: int, out_spec) -> fx.GraphModule:
    """The micro-batches as ``copies`` copies interleaved in one forward and backward
    (decision ``copies``), the loss their only output: a new graph."""
    keep_loss_only(gm, copies, out_spec)
    return multi_copy(gm, copies)


@applies("pipeline", "micro_batches")
def apply_pipeline(gm: fx.GraphModule, ctx: StepContext, switches: Switches, out_spec) -> PipelineRunner:
    """Pipeline stages and micro-batches (decisions ``pipeline``, ``micro_batches``): this
    rank's stage graphs (several model chunks under the interleaved schedule) run by the
    schedule's runner, which turns gradient sync on and off through ``switches``; other
    stages' weights are dropped from ``gm``."""
    d = ctx.plan.decisions
    keep_loss_only(gm, d.micro_batches, out_spec)
    runner = stage_runner(gm, ctx.plan, d.micro_batches, ctx.mesh.stage, switches)
    for t in ctx.aliases:
        if t not in ctx.mine:
            *path, leaf = t.split(".")
            owner = gm.get_submodule(".".join(path)) if path else gm
            if hasattr(owner, leaf):
                delattr(owner, leaf)
    return runner


@applies("grad_buckets", "grad_buffers", "grad_compression")
def apply_grad_sync(tensors: Tensors, ctx: StepContext, zero: Zero | None) -> GradSync:
    """Data-parallel gradient buckets (decisions ``grad_buckets``, ``grad_buffers``,
    ``grad_compression``): the plan's buckets, reduced as they fill."""
    params = []
    zt = zero.targets() if zero is not None else set()
    for t, p in tensors:
        if t not in ctx.mine:
            continue
        if t in zt:
            zp = zero._by_target[t]
            if zero.stage == 3 and zp.other_axes:
                # stage 3: the shard's gradient is still Partial on the other axes
                params.append((t, zp.shard, zp.other_axes))
            continue
        if t in ctx.placements and isinstance(p, nn.Parameter) and p.requires_grad:
            params.append((t, p, ctx.replicated[t]))
    d = ctx.plan.decisions
    return GradSync(params, d.grad_buckets, keep=d.grad_buffers_kept,
                    compression=d.grad_compression, rank=d.compression_rank)


def apply_dparams(pm: nn.Module, tensors: Tensors, ctx: StepContext, zero: Zero | None,
                  grad_sync: GradSync) -> DParams:
    """This stage's parameters as DTensors (and its buffers) registered on ``pm`` under
    the original names (:mod:`autopar.runtime.dparams`), so optimizers,
    ``clip_grad_norm_`` and DCP work; the optimizer steps host copies under
    ``offload="optimizer"``."""
    zt = zero.targets() if zero is not None else set()
    entries = []
    for t, p in tensors:
        if t not in ctx.mine:
            continue
        if t in zt:
            e = _zero_entry(t, zero, ctx)
        elif t in ctx.placements and isinstance(p, nn.Parameter):
            e = DParams.make(t, p, ctx.mesh.param_mesh, ctx.placements[t], ctx.shapes[t], p.requires_grad)
        else:
            for n in ctx.aliases[t]:
                if p is not None:
                    register_tree(pm, n, p, buffer=True, reserved=_RESERVED,
                                  persistent=n not in ctx.info.nonpersistent)
            continue
        if ctx.plan.decisions.offload == "optimizer" and e.param.requires_grad:
            DParams.hosted(e, ctx.mesh.param_mesh)  # the optimizer steps a host copy
        # element-wise steps run on the local tensor (the host copy under offload)
        local_step.mark(e.param, e.host if e.host is not None else e.local)
        entries.append(e)
        for n in ctx.aliases[t]:  # tied weights: one Parameter under every name
            register_tree(pm, n, e.param, reserved=_RESERVED)
    return DParams(ctx.mesh.param_mesh, entries, grad_sync)


def _zero_entry(t: str, zero: Zero, ctx: StepContext) -> Entry:
    """The DTensor parameter of ZeRO's shard of ``t``, its layout checked."""
    mesh, zp = ctx.mesh.param_mesh, zero._by_target[t]
    pl = zero_placements(ctx.placements[t], zero.axes, ctx.plan.mesh.shape)
    check_layout(t, zp.shard, mesh, pl, ctx.placements[t], ctx.shapes[t], zero.start_row(t))
    return DParams.make(t, zp.shard, mesh, pl, ctx.shapes[t], True,
                        hook_on=zp.full if zp.full is not None else zp.shard)


def apply_unused(pm: nn.Module, full_state: Mapping[str, torch.Tensor] | None,
                 ctx: StepContext) -> dict[str, torch.Tensor]:
    """The tensors the forward never reads, registered on ``pm`` whole on every rank
    (replicated) from ``full_state``, so every state dict still has them: name -> tensor."""
    extra: dict[str, torch.Tensor] = {}
    mesh = ctx.mesh.param_mesh
    for n in sorted(ctx.info.unused):
        if full_state is None or n not in full_state:
            continue
        x = full_state[n].detach().clone()
        if n in ctx.info.buffers:
            register_tree(pm, n, x, buffer=True, reserved=_RESERVED,
                          persistent=n not in ctx.info.nonpersistent)
            extra[n] = x
        else:
            dt = nn.Parameter(as_dtensor(x, mesh, (Replicate(),) * mesh.ndim, x.shape),
                              requires_grad=n not in ctx.info.frozen)
            register_tree(pm, n, dt, reserved=_RESERVED)
            local_step.mark(dt, dt._local_tensor)
            extra[n] = dt
    return extra


def apply_checks(habits: LoopHabits) -> None:
    """The first call's agreement check between the ranks
    (:mod:`autopar.runtime.call_check`); the dropout generator stays torch's until
    ``pm.manual_seed``."""
    habits.start_call_check()


__all__ = ["StepContext", "Tensors", "apply_checks", "apply_copies", "apply_device", "apply_dparams",
           "apply_grad_sync", "apply_inputs", "apply_offload", "apply_pipeline", "apply_plan",
           "apply_recompute", "apply_unused", "apply_zero", "to_host"]
