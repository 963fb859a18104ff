"""Lowering: turn the captured graph into the per-rank graph a plan describes.

Before: the annotated aten graph (every node has ``meta["autopar"]``) and a Plan for it.
After: the same graph where

* each placeholder is sliced to its planned placement (callers pass whole inputs);
* every edge whose producer placement differs from the consumer's required input
  placement goes through the collectives of :func:`autopar.sharding.redistribute.plan_redistribution`,
  emitted as calls to :mod:`autopar.runtime.collectives` (one value per (producer,
  placement) is shared by all consumers that need it);
* ops whose local form differs from the global one are rewritten
  (:mod:`autopar.passes.localize`);
* each output is made replicated and wrapped in ``scale_grad(1/world)`` (more than one device) so the loss
  seeds of all ranks sum to one (see the dual-placement convention in
  :mod:`autopar.runtime.collectives`); under ``batch="local"`` a batch-shaped output is
  returned as this rank's rows instead (``Shard(0)`` on :attr:`Decisions.local_axes`),
  and the same scale makes the gradient that of the mean of the ranks' losses, as DDP.

Parameters are not touched here: the module holding the graph stores local shards.
Example (MLP, batch-sharded on a 1-D mesh): ``linear(local_slice(x, 0, 0), w, b)``;
the loss ends in ``pending_sum(scale_grad(mse_loss(...), 1/n), (0,))``.
"""

from __future__ import annotations

import operator

from autopar.passes.localize import HOISTED, SCALED_FROM, localize
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import META_KEY, info, tensor_inputs
from autopar.capture.layers import POST, PRE
from autopar.plans.data import Plan
from autopar.plans.placement import Placements, R, graph_batch, parse_placements
from autopar.runtime import collectives as C
from autopar.runtime.inputs import passthrough_inputs
from autopar.runtime.pending import pending_sum
from autopar.sharding.redistribute import StepKind, plan_redistribution, sum_axes

_EMIT = {
    StepKind.ALL_REDUCE: lambda x, s: (C.all_reduce, (x, s.axis)),
    StepKind.ALL_GATHER: lambda x, s: (C.all_gather, (x, s.dim, s.axis)),
    StepKind.REDUCE_SCATTER: lambda x, s: (C.reduce_scatter, (x, s.dim, s.axis)),
    StepKind.ALL_TO_ALL: lambda x, s: (C.all_to_all, (x, s.dim, s.dim2, s.axis)),
    StepKind.SLICE: lambda x, s: (C.local_slice, (x, s.dim, s.axis)),
    StepKind.TO_PARTIAL: lambda x, s: (C.to_partial, (x, s.axis)),
}


def emit_redistribution(graph: fx.Graph, x: fx.Node, src: Placements, dst: Placements,
                        mesh_shape: tuple[int, ...]) -> fx.Node:
    """Insert the steps turning ``x`` from ``src`` into ``dst`` on a mesh of
    ``mesh_shape`` (none on an axis of one rank) at the graph's current insertion point
    and return the final node."""
    ann = x.meta.get(META_KEY)
    steps = plan_redistribution(src, dst, mesh_shape)
    for step in steps:
        fn, args = _EMIT[step.kind](x, step)
        x = graph.call_function(fn, args)
        _same_global(x, ann)
    if steps:  # what a pipeline's stage sends of it (runtime/stage_wire.py) reads this
        x.meta[PLACEMENT_KEY] = tuple(dst)
    return x


PLACEMENT_KEY = "autopar_placement"
"""``node.meta`` key of a redistribution's result: the placement it holds (a planned
node's is ``plan.nodes[name].out_placements``)."""


def _same_global(node: fx.Node, ann) -> None:
    """A redistribution changes placements, not the global tensor: the collective's
    output carries its input's annotation (global shape and dtype), so local forms of
    the consumer (a mean's rescale, a loss's count) read the global shape through it."""
    if ann is not None:
        node.meta[META_KEY] = ann


def _scalar_output(g: fx.Graph, x: fx.Node, src: Placements, dst: Placements,
                   seed_scale: float, mesh_shape: tuple[int, ...]) -> fx.Node | None:
    """A scalar output (the loss) that is only summed over some axes: scale its seed,
    then start the sum and leave it in flight (:func:`~autopar.runtime.pending.pending_sum`:
    no wait in the forward, no communication in the backward).  None when reaching
    ``dst`` takes more than all-reduces."""
    axes = sum_axes(src, dst, mesh_shape)
    if not axes:
        return None
    y = g.call_function(C.scale_grad, (x, seed_scale))
    y = g.call_function(pending_sum, (y, axes))
    _same_global(y, x.meta.get(META_KEY))
    return y


def out_placement(plan: Plan, node: fx.Node) -> Placements:
    """The planned output placement of ``node``."""
    return parse_placements(plan.nodes[node.name].out_placements[0])


def lower(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Apply the plan to ``gm`` in place (see the module docstring) and return it."""
    g = gm.graph
    shape = tuple(plan.mesh.shape)
    replicated = (R,) * len(shape)
    d = plan.decisions
    # batch="local": batch-shaped outputs go back as this rank's rows (read before the
    # placeholders are sliced)
    rows = graph_batch(gm) if d.batch == "local" and d.local_axes is not None else None
    # value[u]: the graph node that holds u in its planned placement
    value: dict[fx.Node, fx.Node] = {}
    # 1. inputs arrive whole: slice each placeholder to its planned placement, except
    # those a batch="local" call passes as this rank's rows (runtime.inputs)
    keep = passthrough_inputs(plan)
    for node in list(g.nodes):
        if node.op == "placeholder" and node.name in keep:
            value[node] = node
        elif node.op == "placeholder" and node.name in plan.nodes:
            dst = out_placement(plan, node)
            last = node
            for step in plan_redistribution(replicated, dst, shape):
                fn, args = _EMIT[step.kind](last, step)
                with g.inserting_after(last):
                    last = g.call_function(fn, args)
                _same_global(last, node.meta.get(META_KEY))
            value[node] = last
    # 2. redistribute every edge whose placements differ
    cache: dict[tuple[fx.Node, Placements], fx.Node] = {}
    for v in list(g.nodes):
        if v.op != "call_function" or v.name not in plan.nodes or v.target is operator.getitem:
            continue
        np_ = plan.nodes[v.name]
        ins = tensor_inputs(v)
        if [u.name for u in ins] != np_.inputs:
            raise ValueError(f"plan does not match graph at {v.name}: {np_.inputs} vs {[u.name for u in ins]}")
        for i, u in enumerate(ins):
            src = out_placement(plan, u)
            dst = parse_placements(np_.in_placements[i])
            feed = value.get(u, u)
            if src != dst:
                key = (u, dst)
                if key not in cache:
                    with g.inserting_before(v):
                        cache[key] = emit_redistribution(g, feed, src, dst, shape)
                feed = cache[key]
            if feed is not u:
                v.replace_input_with(u, feed)
    # 3. local forms of ops
    localize(gm, plan)
    # 4. outputs: replicated (or this rank's rows), and the loss seeds summed to one
    out = next(n for n in g.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    new_args = []
    for a in flat:
        planned = a.meta.get(SCALED_FROM, a) if isinstance(a, fx.Node) else a
        if isinstance(a, fx.Node) and planned.name in plan.nodes and info(planned).outputs:
            outs = info(planned).outputs
            dst = replicated
            if rows is not None and len(outs) == 1 and outs[0].shape and outs[0].shape[0] == rows:
                # every batch-shaped output on the same axes: the rows the caller passed
                dst = tuple(Shard(0) if i in d.local_axes else R for i in range(len(replicated)))
            src = out_placement(plan, planned)
            with g.inserting_before(out):
                y = None
                if len(outs) == 1 and not outs[0].shape:  # a scalar (the loss)
                    y = _scalar_output(g, a, src, dst, 1.0 / plan.mesh.size, shape)
                if y is None:
                    y = emit_redistribution(g, a, src, dst, shape)
                    if plan.mesh.size > 1:  # one device: the seed is already 1 (no op a step)
                        y = g.call_function(C.scale_grad, (y, 1.0 / plan.mesh.size))
            new_args.append(y)
        else:
            new_args.append(a)
    out.args = (type(out.args[0])(new_args) if isinstance(out.args[0], (tuple, list)) else new_args[0],)
    g.eliminate_dead_code()
    tag_layers(gm, plan)
    g.lint()
    gm.recompile()
    return gm


def tag_layers(gm: fx.GraphModule, plan: Plan) -> None:
    """Set ``node.meta["autopar_layer"]`` on every node of the lowered graph: planned
    nodes take their plan layer; inserted nodes (collectives, local forms) take the
    layer of their first user, since they are emitted right before the op that needs
    them; placeholders belong to ``"pre"`` and the output to ``"post"``.
    Pipeline stages and recomputation segments are cut along these tags."""
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "output":
            n.meta["autopar_layer"] = POST
        elif n.op == "placeholder":
            n.meta["autopar_layer"] = PRE
        elif n.name in plan.nodes and plan.nodes[n.name].layer:
            n.meta["autopar_layer"] = plan.nodes[n.name].layer
        else:
            users = [u for u in n.users if "autopar_layer" in u.meta]
            n.meta["autopar_layer"] = users[0].meta["autopar_layer"] if users else POST
    for n in gm.graph.nodes:
        if n.meta.get(HOISTED):  # emitted next to its input, far from its user
            n.meta["autopar_layer"] = n.args[0].meta["autopar_layer"]
