"""A pipeline schedule's runner of a rank's stage graphs, for the planned shape
(:func:`autopar.module.apply.apply_pipeline`) and for other shapes' lowerings
(:class:`autopar.module.shapes.ShapeRoutes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autopar.capture.grad_flow import loss_output
from autopar.errors import PlanError
from autopar.passes.lower import PLACEMENT_KEY
from autopar.passes.split_stages import split_stages
from autopar.plans.data import Plan
from autopar.plans.placement import parse_placements, replicated_axes
from autopar.plans.splits import sends_sliced
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.stage_wire import BoundarySlices
from autopar.runtime.zero3 import defer

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule


def keep_loss_only(gm: torch.fx.GraphModule, micro_batches: int, out_spec) -> None:
    """Micro-batched plans run ``train_step``, which returns the loss alone: keep only
    the loss among ``gm``'s outputs (a Hugging Face output's ``loss``), so the
    schedule has one value to seed backward with and logits are not gathered."""
    flat, idx = loss_output(gm, out_spec)
    if len(flat) == 1:
        return
    if idx is None:
        raise PlanError(f"this plan runs {micro_batches} micro-batches: "
                        f"the model must return its loss (a scalar tensor, or an output with "
                        f"a 'loss' field), but it returns {len(flat)} values")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((flat[idx],),)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def stage_runner(gm: torch.fx.GraphModule, plan: Plan, micro_batches: int, stage: int,
                 switches: Switches) -> PipelineRunner:
    """The schedule's runner of pipeline stage ``stage``'s graphs of ``gm`` (lowered
    with ``plan``, the loss its only output) over ``micro_batches`` micro-batches,
    turning gradient sync on and off through ``switches``."""
    d = plan.decisions
    # this rank's graph; under the interleaved schedule its chunks s, s + p, ..
    mine = split_stages(gm, plan)[stage::max(1, d.pipeline_stages)]
    return PipelineRunner(mine, d.schedule, micro_batches, switches, boundary_slices(gm, plan, mine))


def boundary_slices(gm: torch.fx.GraphModule, plan: Plan, chunks: list) -> BoundarySlices:
    """The sub-mesh axes each value crossing a boundary of ``chunks`` is sliced over
    (:mod:`autopar.runtime.stage_wire`): those it is replicated over, of more than one
    rank, where the sending pipeline rank is in ``plan.decisions.sliced_sends``.  A
    value whose placement the lowering does not record is sent whole."""
    shape = tuple(plan.mesh.shape)
    d = plan.decisions
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[str, tuple[int, ...]] = {}
    for ch in chunks:
        sent = ch.send if sends_sliced(d, ch.stage) else []
        got = ch.recv if sends_sliced(d, ch.stage - 1) else []
        for name in (*sent, *got):
            node = by_name.get(name)
            if name in plan.nodes:
                pl = parse_placements(plan.nodes[name].out_placements[0])
            elif node is not None and PLACEMENT_KEY in node.meta:
                pl = node.meta[PLACEMENT_KEY]
            else:
                continue
            axes = replicated_axes(pl, shape)
            if axes:
                out[name] = axes
    return BoundarySlices(out)


class Switches:
    """Turns a module's gradient synchronisation (plain and ZeRO) on and off together;
    the pipeline runner keeps it off except for a stage's last backward.  Reads the
    module's gradient buckets, ZeRO and DTensor parameters when used: they are made
    after the runner."""

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
                defer(self._pm.zero.group_keys, not on)

    def flush(self) -> None:
        """Reduce every gradient now (plain buckets, then ZeRO's), then point the
        DTensor parameters' ``.grad`` at the results (what the hooks would have done)."""
        self._pm.grad_sync.flush()
        if self._pm.zero is not None:
            self._pm.zero.flush()
        if self._pm._dparams is not None:
            self._pm._dparams.bridge()


__all__ = ["Switches", "keep_loss_only", "stage_runner"]
