"""Split stages: cut the lowered per-rank graph into one graph per pipeline stage.

Before: a lowered graph (:func:`autopar.passes.lower.lower`) whose nodes carry
``meta["autopar_layer"]``, and a Plan whose ``decisions.stages[s]`` lists the layer keys
of pipeline stage ``s``.  After (the input graph is not modified): one
:class:`StageGraph` per stage, each an ``fx.GraphModule`` called as ::

    stage.module(*[inputs[i] for i in stage.inputs], *received) -> (*sent, *outputs)

* ``inputs`` are the model's (flat) inputs this stage reads, by position;
* ``received`` are the boundary values from stage ``s-1``, in the order of
  ``stage.recv`` (node names of the lowered graph);
* ``sent`` are the boundary values for stage ``s+1``, in the order of ``stage.send``
  (stage ``s``'s ``send`` equals stage ``s+1``'s ``recv``);
* ``outputs`` are the model's outputs (the loss): on the last stage only.

Rules:

* a computing node belongs to stage ``plan.decisions.stage_of(node.meta["autopar_layer"])``;
  ``getitem`` nodes stay with the node they read.  The stage must never decrease in
  graph order (a :class:`PlanError` names the offending node otherwise);
* a node that depends on model inputs only (``local_slice``/``view`` of the labels,
  ``arange``) is computed in every stage that uses it, like the placeholders: these are
  free views, and keeping them out of the boundaries keeps integer tensors off the
  wire.  Random ops are never copied (the copies would differ);
* a value made in stage ``s`` and used in stage ``t > s + 1`` is *forwarded* through
  stages ``s+1 .. t-1`` (each passes it on unchanged; its gradient flows back the same
  way).  So every stage talks to its two neighbours only and the point-to-point
  traffic of a micro-batch is one message list per neighbour and direction, which
  keeps the runner's send/receive order trivially consistent (see
  :mod:`autopar.runtime.pipeline`);
* parameters stay the very same ``Parameter`` objects of ``gm`` (the stage modules hold
  references, so gradients land on ``gm``'s parameters); a parameter used by two stages
  (tied weights) raises :class:`PlanError`: its gradient would have to be summed across
  stages, which this runtime does not do.  Buffers may be shared (no gradient).

Example (GPT, 2 blocks, ``stages=[["pre", "blocks.0"], ["blocks.1", "post"]]``)::

    stage 0: forward(tokens)                -> (add_2,)        # residual after block 0
    stage 1: forward(labels, add_2)         -> (scale_grad,)   # the loss

Stage modules share parameters with ``gm`` by reference: split *after* the parameters
hold their final (sharded) tensors, since replacing a Parameter object on ``gm`` later
is not seen by the stages (copying into it in place is).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from autopar.errors import PlanError
from autopar.plans.data import Plan
from autopar.runtime.stage_graph import StageGraph

LAYER_KEY = "autopar_layer"


def _resolve(gm: nn.Module, target: str) -> object:
    return functools.reduce(getattr, target.split("."), gm)


def _state_of(gm: fx.GraphModule, node: fx.Node) -> tuple[dict[str, nn.Parameter], list[str]]:
    """Parameters (target -> object) and buffer targets a get_attr/call_module node uses;
    a module (a checkpointed layer, a submodule call) contributes all of its own."""
    obj = _resolve(gm, node.target)
    if isinstance(obj, nn.Parameter):
        return {node.target: obj}, []
    if isinstance(obj, torch.Tensor):
        return {}, [node.target]
    if isinstance(obj, nn.Module):
        params = {f"{node.target}.{n}": p for n, p in obj.named_parameters()}
        return params, [f"{node.target}.{n}" for n, _ in obj.named_buffers()]
    return {}, []


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def input_only(nodes: list[fx.Node]) -> set[fx.Node]:
    """Computing nodes whose inputs are model inputs or other such nodes (no
    parameters, no activations): copied into every stage that needs them."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op not in ("call_function", "call_method") or _is_random(n):
            continue
        if all(a.op == "placeholder" or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _assign(gm: fx.GraphModule, plan: Plan, copied: set[fx.Node]) -> dict[fx.Node, int]:
    """Stage of every computing node (not placeholders, get_attr, input-only nodes)."""
    d = plan.decisions
    num = _num_stages(plan)
    if num > 1 and len(d.stages) != num:
        raise PlanError(f"the plan has {num} (virtual) pipeline stages but decisions.stages "
                        f"lists {len(d.stages)} layer groups")
    stage: dict[fx.Node, int] = {}
    last: fx.Node | None = None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or n in copied:
            continue
        if n.op == "call_function" and n.target is operator.getitem and \
                n.args[0] in stage:
            stage[n] = stage[n.args[0]]  # a tuple's parts never cross a boundary
        elif num == 1:
            stage[n] = 0
        else:
            layer = n.meta.get(LAYER_KEY)
            if layer is None:
                raise PlanError(f"node {n.name} has no meta[{LAYER_KEY!r}]: split the graph "
                                "that lower() returned (it tags every node with its layer)")
            try:
                stage[n] = d.stage_of(layer)
            except KeyError as e:
                raise PlanError(f"node {n.name} is in layer {layer!r}, which no pipeline "
                                f"stage lists (stages: {d.stages})") from e
        if last is not None and stage[n] < stage[last]:
            raise PlanError(
                f"pipeline stages are not monotone in graph order: {n.name} (layer "
                f"{n.meta.get(LAYER_KEY)!r}, stage {stage[n]}) comes after {last.name} (layer "
                f"{last.meta.get(LAYER_KEY)!r}, stage {stage[last]}); stages must hold "
                "consecutive layers in execution order")
        last = n
    return stage


def _num_stages(plan: Plan) -> int:
    """Stage graphs the plan cuts: its pipeline stages times its virtual stages."""
    d = plan.decisions
    return max(1, d.pipeline_stages) * max(1, d.virtual_stages)


def _needed_copies(users_of_stage: list[fx.Node], copied: set[fx.Node]) -> set[fx.Node]:
    """Input-only nodes a stage must compute: those its nodes read, transitively."""
    need: set[fx.Node] = set()
    todo = [a for n in users_of_stage for a in n.all_input_nodes if a in copied]
    while todo:
        a = todo.pop()
        if a in need:
            continue
        need.add(a)
        todo.extend(b for b in a.all_input_nodes if b in copied)
    return need


def split_stages(gm: fx.GraphModule, plan: Plan) -> list[StageGraph]:
    """Cut ``gm`` (lowered with ``plan``) into one :class:`StageGraph` per pipeline stage
    (per virtual stage under the interleaved schedule: rank ``s`` of ``p`` runs graphs
    ``s, s + p, ..``; a parameter two of them use is then shared, and summed by autograd).

    See the module docstring for the contract.  Without a pipeline
    (``pipeline_stages <= 1``) the result is one stage holding the whole graph (the
    runner then does plain gradient accumulation).  Raises :class:`PlanError` for
    untagged nodes, layers in no stage, non-monotone stages and parameters used by two
    stages.
    """
    nodes = list(gm.graph.nodes)
    num = _num_stages(plan)
    copied = input_only(nodes)
    stage = _assign(gm, plan, copied)
    members, crossing = _crossings(nodes, stage, num)
    params, buffers = _stage_state(gm, nodes, stage, num, max(1, plan.decisions.pipeline_stages))
    cut = _Cut(gm, plan, nodes, num, stage, copied, members, crossing, params, buffers)
    return [_stage_graph(cut, s) for s in range(num)]


@dataclass(frozen=True)
class _Cut:
    """The graph's nodes assigned to stages: what each stage's graph is built from."""

    gm: fx.GraphModule
    plan: Plan
    nodes: list[fx.Node]
    num: int
    stage: dict[fx.Node, int]
    """Each computing node's stage (the nodes every stage copies are in none)."""
    copied: set[fx.Node]
    """The nodes that depend on model inputs only, computed where they are used."""
    members: list[list[fx.Node]]
    crossing: list[list[fx.Node]]
    """Per link ``s -> s + 1``, the values that cross it, in graph order."""
    params: list[dict[str, nn.Parameter]]
    buffers: list[list[str]]


def _crossings(nodes: list[fx.Node], stage: dict[fx.Node, int],
               num: int) -> tuple[list[list[fx.Node]], list[list[fx.Node]]]:
    """Each stage's nodes, and the values crossing each link: value ``v`` crosses every
    link ``s -> s + 1`` from its own stage to the latest stage that reads it (forwarded
    through the stages between).  Raises :class:`PlanError` for a value that is not a
    tensor (it cannot be sent)."""
    members: list[list[fx.Node]] = [[] for _ in range(num)]
    for n in nodes:
        if n in stage:
            members[stage[n]].append(n)
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for u in n.users:
            t = num - 1 if u.op == "output" else stage.get(u)
            if t is not None and n in stage and t > stage[n]:
                last_use[n] = max(last_use.get(n, -1), t)
    crossing: list[list[fx.Node]] = [[] for _ in range(max(0, num - 1))]
    for v in nodes:
        if v in last_use:
            val = v.meta.get("val")
            if val is not None and not isinstance(val, torch.Tensor):
                raise PlanError(f"{v.name} crosses a pipeline stage boundary but is not a "
                                "tensor; move the cut so it stays inside one stage")
            for s in range(stage[v], last_use[v]):
                crossing[s].append(v)
    return members, crossing


def _stage_state(gm: fx.GraphModule, nodes: list[fx.Node], stage: dict[fx.Node, int], num: int,
                 ranks: int) -> tuple[list[dict[str, nn.Parameter]], list[list[str]]]:
    """Each stage's parameters (by target) and buffers.  A parameter (by identity) that
    two pipeline ranks use is a tied weight: :class:`PlanError`, its gradient would have
    to be summed across stages; virtual stages of one rank may share it (autograd sums
    its gradient)."""
    owner: dict[int, tuple[int, str, str]] = {}
    stage_params: list[dict[str, nn.Parameter]] = [{} for _ in range(num)]
    stage_buffers: list[list[str]] = [[] for _ in range(num)]
    for n in nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        params, buffers = _state_of(gm, n)
        using = {stage[u] for u in n.users if u in stage} if n.op == "get_attr" else {stage[n]}
        for s in sorted(using):
            for t, p in params.items():
                prev = owner.setdefault(id(p), (s, t, n.name))
                if prev[0] % ranks != s % ranks:
                    also = f" (as {prev[1]!r})" if prev[1] != t else ""
                    raise PlanError(
                        f"parameter {t!r} is used by pipeline stages {prev[0] % ranks}{also} "
                        f"and {s % ranks} (tied weights): its gradient would have to be summed across "
                        "stages; put all its users in one stage or untie the weights")
                stage_params[s][t] = p
            stage_buffers[s].extend(b for b in buffers if b not in stage_buffers[s])
    return stage_params, stage_buffers


def _stage_graph(cut: _Cut, s: int) -> StageGraph:
    """Stage ``s``'s graph: the model inputs it reads, the values it receives, the
    attributes its nodes read, its own nodes and the input-only ones it copies; it
    returns what it sends, then (the last stage) the model's outputs."""
    nodes, stage, num = cut.nodes, cut.stage, cut.num
    out_node = next(n for n in nodes if n.op == "output")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    is_last = s == num - 1
    readers = cut.members[s] + ([out_node] if is_last else [])
    copies = _needed_copies(readers, cut.copied)
    wanted = {a for n in readers + sorted(copies, key=nodes.index)
              for a in n.all_input_nodes if a.op == "placeholder"}
    used_inputs = [i for i, p in enumerate(placeholders) if p in wanted]
    for i in used_inputs:
        env[placeholders[i]] = g.node_copy(placeholders[i])
    recv = cut.crossing[s - 1] if s > 0 else []
    for v in recv:
        env[v] = g.placeholder(v.name)
        env[v].meta = dict(v.meta)
    for n in nodes:
        if n.op == "get_attr" and any(stage.get(u) == s or (is_last and u is out_node)
                                      for u in n.users):
            env[n] = g.node_copy(n)
    for n in nodes:
        if (n in stage and stage[n] == s) or n in copies:
            env[n] = g.node_copy(n, env.__getitem__)
    send = cut.crossing[s] if s < num - 1 else []
    outs = [env[v] for v in send]
    model_outs: list = []
    if is_last:
        flat = out_node.args[0]
        flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        model_outs = [fx.map_arg(a, env.__getitem__) for a in flat]
    g.output(tuple(outs + model_outs))
    g.lint()
    mod = fx.GraphModule(cut.gm, g, class_name=f"Stage{s}")
    stages = cut.plan.decisions.stages
    return StageGraph(
        stage=s, num_stages=num, module=mod, inputs=used_inputs,
        recv=[v.name for v in recv], send=[v.name for v in send],
        num_outputs=len(model_outs),
        layers=list(stages[s]) if s < len(stages) else [],
        params=list(cut.params[s]), buffers=cut.buffers[s],
        input_shapes=[_shape(placeholders[i]) for i in used_inputs])


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(int(x) for x in val.shape) if isinstance(val, torch.Tensor) else None


__all__ = ["LAYER_KEY", "input_only", "split_stages"]
