"""How a plan is applied to its module: one function per decision, run by
:func:`apply_plan` in this fixed order (torchtitan's ``apply_*`` habit), so the order
things happen in is visible in one place.

1. :func:`apply_inputs`: who passes which samples (decision ``batch``);
2. :func:`apply_device`: weights, buffers and the graph's constants on the rank's device;
3. :func:`apply_zero`: ZeRO 1/2/3 (decisions ``zero``, ``zero_kept``, ``zero_reduce_once``),
   then :func:`apply_offload`: ZeRO-3's shards in host memory (decision ``offload``;
   the optimizer level is applied with the DTensor parameters, step 7);
4. :func:`apply_recompute`: recomputed layers (decision ``recompute``);
5. :func:`apply_pipeline`: pipeline stages and micro-batches, run by the schedule's runner
   (decisions ``pipeline``, ``micro_batches``);
6. :func:`apply_grad_sync`: gradient buckets (decisions ``grad_buckets``, ``grad_buffers``);
7. :func:`apply_dparams`: parameters as DTensors under the original names;
8. :func:`apply_checks`: the dropout generator and the first call's agreement check.

Decisions that shape the graph itself are applied before the module exists: precision
at capture (:func:`autopar.capture.mixed_precision.apply_mixed_precision`), placements and
context parallelism in lowering (:mod:`autopar.passes`).  The registry
(:mod:`autopar.plan.decisions`) names each decision's function here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from autopar.capture.grad_flow import named_loss
from autopar.module.loop import move_to_device
from autopar.runtime.inputs import BatchMode, InputBinder, data_parallel_axes, passthrough_inputs

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule


# attribute names of ParallelModule itself: a model's top-level submodule or parameter
# of the same name could not be registered under its own name
_RESERVED = frozenset({"inner", "plan", "aliases", "state_keys", "rank", "runner", "zero", "rng",
                       "grad_sync", "lowered_graph", "code", "binder", "info", "training",
                       "routes", "generate"})


def apply_plan(pm: ParallelModule, full_state: Mapping[str, torch.Tensor] | None) -> None:
    """Apply every runtime decision of ``pm.plan`` to ``pm``, in the module docstring's
    order (under a process group; a planning-only module gets :func:`apply_inputs` only)."""
    apply_device(pm)
    apply_zero(pm)
    apply_offload(pm)
    apply_recompute(pm)
    apply_pipeline(pm)
    apply_grad_sync(pm)
    apply_dparams(pm, full_state)
    apply_checks(pm)


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
    from autopar.module.shapes import Route, ShapeRoutes
    pm.routes = ShapeRoutes(Route(None, list(binder.shapes), binder.passthrough))
    pm._route = pm.routes.planned
    binder.select = pm._select_route if pm._mesh_rt is not None else None


def apply_device(pm: ParallelModule) -> None:
    """One device per process (cuda:LOCAL_RANK under NCCL): weights, buffers and the
    graph's constants move there before anything views them; frozen parameters stay so."""
    from autopar.passes.device import set_device

    move_to_device(pm.inner, pm._mesh_rt.device)
    set_device([m for m in pm.inner.modules() if isinstance(m, torch.fx.GraphModule)],
               pm._mesh_rt.device)
    for t, p in pm._targets():  # also for modules loaded from an export
        if isinstance(p, nn.Parameter) and pm._frozen(t):
            p.requires_grad_(False)


def apply_zero(pm: ParallelModule) -> None:
    """ZeRO (decisions ``zero``, ``zero_kept``, ``zero_reduce_once``, ``gather_chunks``):
        replicated parameters sharded over the plan's ZeRO axes, their optimizer state (1),
        gradients (2) and parameters (3, gathered per layer, the kept layers left
        gathered); stages 1-2 gather the updated parameters in the plan's chunks."""
    from autopar.runtime.zero import Zero
    d = pm.plan.decisions
    z = tuple(a for a in d.zero_axes if pm.plan.mesh.shape[a] > 1)
    if not z:
        return
    params = []
    for t, p in pm._targets():
        if not pm._mine(t):
            continue
        # a parameter replicated on every ZeRO axis (one sharded on some of them by
        # the plan keeps its placement and its gradient sync; so does a 0-d one:
        # Shard(0) has no dim to cut)
        if t in pm._placements and isinstance(p, nn.Parameter) and p.requires_grad \
                and p.dim() > 0 and set(z) <= set(pm._replicated_axes(t)):
            params.append((t, tuple(a for a in pm._replicated_axes(t) if a not in z)))
    layers = {n.param: n.layer for n in pm.plan.nodes.values() if n.param and n.layer}
    if d.gather_chunks and (d.zero_stage not in (1, 2) or d.pipeline_stages > 1):
        from autopar.errors import PlanError
        raise PlanError("this plan gathers ZeRO's parameters in chunks (gather_chunks), which runs "
                        "with ZeRO-1 or 2 on one pipeline stage only; plan it again")
    pm.zero = Zero.install(pm.inner, params, d.zero_stage, z, layers, frozenset(d.zero_kept),
                           d.gather_chunks)


def apply_offload(pm: ParallelModule) -> None:
    """Host memory (decision ``offload``).  ``"params"``: ZeRO-3's shards move there
    (pinned on CUDA, so the gathers copy them up asynchronously), before the DTensor
    parameters view them, so the optimizer steps them where they are.  ``"optimizer"``:
    :func:`apply_dparams` gives each DTensor parameter a host copy to step
    (:class:`~autopar.runtime.dparams.DParams`)."""
    d = pm.plan.decisions
    if d.offload != "params":
        return
    if pm.zero is None or pm.zero.stage != 3 or any(zp.other_axes for zp in pm.zero.params):
        from autopar.errors import PlanError
        raise PlanError("this plan keeps parameter shards in host memory (offload='params'), which "
                        "needs ZeRO-3 over every replicated axis of the parameters; plan it again")
    r = pm._mesh_rt.coord_of(pm.zero.axes)
    for zp in pm.zero.params:
        zp.flat.data = to_host(zp.flat.data)
        zp.shard.data = zp.cut.view(zp.flat, r)  # the parameter still views what is sent


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (pinned when CUDA is there, for asynchronous copies); a CPU
    tensor as it is."""
    if t.device.type == "cpu":
        return t
    return t.to("cpu").pin_memory() if torch.cuda.is_available() else t.to("cpu")


def apply_recompute(pm: ParallelModule) -> None:
    """Recompute the planned layers (decision ``recompute``)."""
    d = pm.plan.decisions
    from autopar.plan.schedules import conflict
    why = conflict(d.schedule, bool(d.recompute), d.zero_stage)
    if why:  # a plan file edited or made elsewhere: the search never makes one
        from autopar.errors import PlanError
        raise PlanError(f"this plan runs schedule {d.schedule!r} with {why}; plan it again")
    if d.recompute:
        from autopar.passes.recompute import recompute
        recompute(pm.inner, set(d.recompute))


def apply_pipeline(pm: ParallelModule) -> None:
    """Pipeline stages and micro-batches (decisions ``pipeline``, ``micro_batches``): this
    rank's stage graphs (several model chunks under the interleaved schedule) run by the
    schedule's runner; other stages' weights are dropped."""
    d = pm.plan.decisions
    if d.zero_reduce_once and (d.zero_stage != 3 or d.pipeline_stages > 1):
        # the runner turns sync on at a rank's last backward only: other pipeline
        # chunks' sums would never be reduced
        from autopar.errors import PlanError
        raise PlanError("this plan reduces ZeRO-3 gradients once a step (zero_reduce_once) with "
                        f"zero_stage={d.zero_stage} and {d.pipeline_stages} pipeline stages: it "
                        "needs zero_stage=3 and no pipeline; plan it again")
    if d.pipeline_stages == 1 and d.micro_batches == 1:
        return
    if d.copies > 1:  # the micro-batches as copies interleaved in one graph
        from autopar.passes.multi_copy import multi_copy
        if d.pipeline_stages > 1 or d.micro_batches != d.copies:
            from autopar.errors import PlanError
            raise PlanError(f"this plan runs {d.copies} copies with {d.micro_batches} micro-batches "
                            f"over {d.pipeline_stages} stages; plan it again")
        keep_loss_only(pm.inner, d.micro_batches, pm._out_spec)
        object.__setattr__(pm, "inner", multi_copy(pm.inner, d.copies))  # not a submodule
        return
    keep_loss_only(pm.inner, d.micro_batches, pm._out_spec)
    runner = stage_runner(pm, pm.inner, pm.plan, d.micro_batches)
    for t in list(pm.aliases):
        if not pm._mine(t):
            owner, leaf = pm._owner_of(t)
            if hasattr(owner, leaf):
                delattr(owner, leaf)
    pm.runner = runner


def keep_loss_only(gm: torch.fx.GraphModule, micro_batches: int, out_spec) -> None:
    """Micro-batched plans run ``train_step``, which returns the loss alone: keep only
    the loss among ``gm``'s outputs (a Hugging Face output's ``loss``), so the
    schedule has one value to seed backward with and logits are not gathered."""
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    if len(flat) == 1:
        return
    idx = named_loss(len(flat), out_spec)
    if idx is None:
        from autopar.errors import PlanError
        raise PlanError(f"this plan runs {micro_batches} micro-batches: "
                        f"the model must return its loss (a scalar tensor, or an output with "
                        f"a 'loss' field), but it returns {len(flat)} values")
    out.args = ((flat[idx],),)
    g.eliminate_dead_code()
    gm.recompile()


def stage_runner(pm: ParallelModule, gm: torch.fx.GraphModule, plan, micro_batches: int):
    """The schedule's runner of this rank's stage graphs of ``gm`` (lowered with
    ``plan``, the loss its only output) over ``micro_batches`` micro-batches."""
    from autopar.passes.split_stages import split_stages
    from autopar.runtime.pipeline import PipelineRunner

    d = plan.decisions
    # this rank's graph; under the interleaved schedule its chunks s, s + p, ..
    mine = split_stages(gm, plan)[pm._mesh_rt.stage::max(1, d.pipeline_stages)]
    return PipelineRunner(mine, d.schedule, micro_batches, _Switches(pm))


def apply_grad_sync(pm: ParallelModule) -> None:
    """Data-parallel gradient buckets (decisions ``grad_buckets``, ``grad_buffers``,
    ``grad_compression``): the plan's buckets, reduced as they fill."""
    from autopar.runtime.grad_sync import GradSync
    params = []
    zt = pm.zero.targets() if pm.zero is not None else set()
    for t, p in pm._targets():
        if not pm._mine(t):
            continue
        if t in zt:
            zp = pm.zero._by_target[t]
            if pm.zero.stage == 3 and zp.other_axes:
                # stage 3: the shard's gradient is still Partial on the other axes
                params.append((t, zp.shard, zp.other_axes))
            continue
        if t in pm._placements and isinstance(p, nn.Parameter) and p.requires_grad:
            params.append((t, p, pm._replicated_axes(t)))
    d = pm.plan.decisions
    pm.grad_sync = GradSync(params, d.grad_buckets, keep=d.grad_buffers_kept,
                            compression=d.grad_compression, rank=d.compression_rank)


def apply_dparams(pm: ParallelModule, full_state: Mapping[str, torch.Tensor] | None) -> None:
    """This stage's parameters as DTensors (and its buffers) under the original names
        (:mod:`autopar.runtime.dparams`), so optimizers, ``clip_grad_norm_`` and DCP work."""
    from torch.distributed.tensor import Replicate

    from autopar.runtime import local_step
    from autopar.runtime.dparams import DParams, register_tree
    from autopar.runtime.zero_layout import check as check_layout
    from autopar.runtime.zero_layout import placements as zero_placements
    mesh = pm._mesh_rt.param_mesh
    zt = pm.zero.targets() if pm.zero is not None else set()
    entries = []
    for t, p in pm._targets():
        if not pm._mine(t):
            continue
        names = pm.aliases[t]
        if t in zt:
            zp = pm.zero._by_target[t]
            pl = zero_placements(pm._placements[t], pm.zero.axes, pm.plan.mesh.shape)
            shape = tuple(pm._param_nodes[t].shape[0])
            check_layout(t, zp.shard, mesh, pl, pm._placements[t], shape, pm.zero.start_row(t))
            e = DParams.make(t, zp.shard, mesh, pl, shape, True,
                             hook_on=zp.full if zp.full is not None else zp.shard)
        elif t in pm._placements and isinstance(p, nn.Parameter):
            e = DParams.make(t, p, mesh, pm._placements[t], tuple(pm._param_nodes[t].shape[0]),
                             p.requires_grad)
        else:
            for n in names:
                if p is not None:
                    register_tree(pm, n, p, buffer=True, reserved=_RESERVED,
                                  persistent=n not in pm.info.nonpersistent)
            continue
        if pm.plan.decisions.offload == "optimizer" and e.param.requires_grad:
            DParams.hosted(e, mesh)  # the optimizer steps a host copy
        # element-wise steps run on the local tensor (the host copy under offload)
        local_step.mark(e.param, e.host if e.host is not None else e.local)
        entries.append(e)
        pm._entry[t] = e
        for n in names:  # tied weights: one Parameter under every name
            register_tree(pm, n, e.param, reserved=_RESERVED)
    # tensors the forward never reads: kept whole on every rank (replicated)
    from autopar.runtime.dparams import as_dtensor
    for n in sorted(pm.info.unused):
        if full_state is None or n not in full_state:
            continue
        x = full_state[n].detach().clone()
        if n in pm.info.buffers:
            register_tree(pm, n, x, buffer=True, reserved=_RESERVED,
                          persistent=n not in pm.info.nonpersistent)
            pm._extra[n] = x
        else:
            dt = nn.Parameter(as_dtensor(x, mesh, (Replicate(),) * mesh.ndim, x.shape),
                              requires_grad=n not in pm.info.frozen)
            register_tree(pm, n, dt, reserved=_RESERVED)
            local_step.mark(dt, dt._local_tensor)
            pm._extra[n] = dt
    pm._dparams = DParams(mesh, entries, getattr(pm, "grad_sync", None))


def apply_checks(pm: ParallelModule) -> None:
    """The dropout generator (torch's, until ``pm.manual_seed``) and the first call's
    agreement check between the ranks (:mod:`autopar.runtime.call_check`)."""
    pm._start_rng()
    pm._start_call_check()


class _Switches:
    """Turns gradient synchronisation (plain and ZeRO) on and off together; the
    pipeline runner keeps it off except for a stage's last backward."""

    def __init__(self, pm: ParallelModule) -> None:
        self._pm = pm

    @property
    def enabled(self) -> bool:
        """Whether gradient hooks reduce."""
        return self._pm.grad_sync.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._pm.grad_sync.enabled = on
        if self._pm.zero is not None:
            self._pm.zero.enabled = on
            if self._pm.plan.decisions.zero_reduce_once:
                # ZeRO-3 reduce-scatters in the backward where sync is on (the last)
                from autopar.runtime.zero3 import defer
                defer(self._pm.zero.group_keys, not on)

    def flush(self) -> None:
        """Reduce every gradient now (plain buckets, then ZeRO's), then point the
        DTensor parameters' ``.grad`` at the results (what the hooks would have done)."""
        self._pm.grad_sync.flush()
        if self._pm.zero is not None:
            self._pm.zero.flush()
        if self._pm._dparams is not None:
            self._pm._dparams.bridge()


__all__ = ["apply_checks", "apply_device", "apply_dparams", "apply_grad_sync", "apply_inputs",
           "apply_offload", "apply_pipeline", "apply_plan", "apply_recompute", "apply_zero", "to_host"]
