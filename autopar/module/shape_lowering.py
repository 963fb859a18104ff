"""Lowering a plan at a shape other than the one it was searched at
(:mod:`autopar.module.shapes` chooses when): whether the graph captured there is the
planned one, which mesh axes must compute a dim whole because it does not divide by
them, and the lowering adopted by the module (its own parameters, the runtime's graph
rewrites, and under a pipeline or micro-batches its schedule's runner)."""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import fx
from torch.distributed.tensor import Replicate, Shard

from autopar.capture.ir import info, tensor_inputs
from autopar.passes.device import set_device
from autopar.passes.recompute import recompute
from autopar.plans.data import Plan
from autopar.plans.placement import fmt_placements, is_replicate, parse_placements
from autopar.plans.splits import unsplit_axes
from autopar.runtime.inputs import InputMismatchError

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule

Shapes = tuple[tuple[int, ...] | None, ...]


def same_graph(gm: fx.GraphModule, plan: Plan) -> bool:
    """Whether ``gm`` has the planned graph's ops on the same inputs (what lowering
    checks node by node)."""
    for n in gm.graph.nodes:
        np_ = plan.nodes.get(n.name)
        if n.op == "call_function" and n.target is not operator.getitem:
            if np_ is None or [u.name for u in tensor_inputs(n)] != np_.inputs:
                return False
    return True


def fit_plan(plan: Plan, gm: fx.GraphModule, binder, want: Shapes) -> tuple[Plan, set[int]]:
    """``plan`` for the graph ``gm`` captured at ``want``: as it is where every split dim
    divides by its axes; else with as few axes as make every split divide dropped from
    the activations (replicated there: a batch of 8 on 2 x 8 ranks splits 8 ways on the
    second axis), when they split no parameter."""
    mesh = plan.mesh.shape
    dropped: set[int] = set()
    while True:
        bad = _undivided(plan, gm, dropped)
        if not bad:
            break
        dropped.update(unsplit_axes(*bad, mesh))
    if not dropped:
        return plan, dropped
    split = sorted(a for a in dropped if any(not is_replicate(parse_placements(p)[a])
                                              for p in plan.params().values()))
    if split:
        n = math.prod(mesh[a] for a in dropped)
        raise InputMismatchError(
            f"{shapes_text(binder, want)}: a dim this plan splits over mesh axes "
            f"{sorted(dropped)} does not divide by their {n} ranks, and axes {split} also split "
            f"parameters, so they cannot compute it whole: pad the batch and the sequence to "
            f"multiples of {n} (a collator's pad_to_multiple_of={n}), with the padding masked")
    return _drop_axes(plan, dropped), dropped


def _undivided(plan: Plan, gm: fx.GraphModule, dropped: set[int]) -> tuple[int, list[int]] | None:
    """(size, axes) of the first activation dim that the axes not in ``dropped`` split
    unevenly, or ``None``."""
    mesh = plan.mesh.shape
    for n in gm.graph.nodes:
        np_ = plan.nodes.get(n.name)
        if np_ is None or np_.param or "autopar" not in n.meta:
            continue
        outs = info(n).outputs
        for k, text in enumerate(np_.out_placements[:len(outs)]):
            shape = outs[k].shape
            pl = parse_placements(text)
            for dim in sorted({p.dim for p in pl if isinstance(p, Shard)}):
                axes = [a for a, p in enumerate(pl)
                        if isinstance(p, Shard) and p.dim == dim and a not in dropped]
                if axes and dim < len(shape) and shape[dim] % math.prod(mesh[a] for a in axes):
                    return shape[dim], axes
    return None


def _drop_axes(plan: Plan, axes: set[int]) -> Plan:
    """``plan`` with every activation replicated on ``axes`` (no split, no partial sum):
    the ranks along them compute the same whole values."""
    def fix(text: str) -> str:
        pl = parse_placements(text)
        return fmt_placements(tuple(Replicate() if a in axes else p for a, p in enumerate(pl)))

    nodes = {k: (v if v.param else replace(v, in_placements=[fix(t) for t in v.in_placements],
                                           out_placements=[fix(t) for t in v.out_placements]))
             for k, v in plan.nodes.items()}
    d = plan.decisions
    local = None if d.local_axes is None else [a for a in d.local_axes if a not in axes]
    return replace(plan, nodes=nodes, decisions=replace(d, local_axes=local))


def adopt(pm: ParallelModule, gm: fx.GraphModule) -> fx.GraphModule:
    """The lowered graph ``gm`` reading ``pm``'s own parameters, buffers and constants,
    with the runtime's graph rewrites applied as to the planned graph."""
    if pm.zero is not None:
        pm.zero.rewrite(gm)
    root: dict[str, object] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target in root:
            continue
        get = operator.attrgetter(n.target)
        try:
            root[n.target] = get(pm.inner)
        except AttributeError:  # a constant captured at this shape alone
            root[n.target] = get(gm).to(pm._mesh_rt.device)
    new = fx.GraphModule(root, gm.graph)
    new._in_spec, new._out_spec = getattr(gm, "_in_spec", None), getattr(gm, "_out_spec", None)
    if pm.plan.decisions.recompute:
        recompute(new, set(pm.plan.decisions.recompute))
    set_device([new], pm._mesh_rt.device)
    new.recompile()
    return new


def shapes_text(binder, shapes, prefix: str = "called with ") -> str:
    parts = [f"{binder.names[i] if i < len(binder.names) else i} {tuple(s)}"
             for i, s in enumerate(shapes) if s is not None]
    return prefix + ", ".join(parts)


__all__ = ["Shapes", "adopt", "fit_plan", "same_graph", "shapes_text"]
