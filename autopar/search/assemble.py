"""The solver's choice, one strategy per node, turned into a :class:`~autopar.plans.Plan`:
per-node prices, the redistributions on each input, the best alternatives (each
strategy's price with the neighbours' choices fixed), memory by kind and the solver's
status and gap. Shared by the ILP and D-Rec (:mod:`autopar.search.op_placement`), so a plan means the
same whoever chose it."""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import numpy as np
from torch import fx

from autopar.capture.grad_flow import dual
from autopar.capture.ir import info, tensor_inputs
from autopar.capture.layers import layer_keys
from autopar.cost_models import MeshSpec
from autopar.plans.data import Alternative, NodePlan, Plan, Redistribution, SolverInfo
from autopar.plans.placement import fmt_placements
from autopar.search.node_prices import CostModel, param_state_split
from autopar.sharding.local_forms import describe
from autopar.sharding.redistribute import plan_redistribution
from autopar.sharding.rules import OpStrategy

if TYPE_CHECKING:
    from autopar.plans.decisions import PlanOptions
    from autopar.search.op_placement import Problem


def _kind(n: fx.Node) -> str:
    if n.op == "placeholder":
        return "input"
    if n.op == "get_attr":
        return "param" if info(n).param else "buffer"
    return "op"


def _op_name(n: fx.Node) -> str:
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target)).replace(".default", "")
    return n.op


def _lowering_fields(n: fx.Node, s: OpStrategy, mesh: MeshSpec, cm: CostModel,
                     kind: str) -> dict:
    """``NodePlan.lowering`` and ``own_comm`` (only ops that communicate themselves have
    them: pricing every node again would cost a second per plan on a Llama), and
    ``dtype``: what only a plan that is shown or lowered reads."""
    lowering = describe(n, s, mesh) if kind == "op" else ""
    outs = info(n).outputs
    # the dtype Plan.predict prices bytes and FLOPs in (an attribute read per node)
    dtype = str(outs[0].dtype).removeprefix("torch.") if outs else ""
    return {"lowering": lowering, "own_comm": float(cm.op_time(n, s)[1]) if lowering else 0.0,
            "dtype": dtype}


def _alternatives(n: fx.Node, pb: Problem, index: dict[fx.Node, int],
                  incident: dict[fx.Node, list[tuple[int, np.ndarray, bool]]],
                  chosen: dict[fx.Node, int]) -> tuple[float, list[Alternative]]:
    """Every strategy's price with the neighbours' choices fixed (its own cost plus its
    edges'), as one vector: the chosen one's (``local``) and the best five others (only
    they are formatted: the rest is most of the work)."""
    mine = chosen[n]
    sec = np.array(pb.problem.node_costs[index[n]], dtype=np.float64)
    for other, m, is_in in incident[n]:
        oc = chosen[pb.nodes[other]]
        sec += m[oc, :] if is_in else m[:, oc]
    alts = []
    for j in np.argsort(sec, kind="stable"):
        if len(alts) == 5 or not math.isfinite(sec[j]):
            break
        if j != mine:
            ins, outs = pb.strategies[n][j].formatted
            alts.append(Alternative(list(ins), list(outs), float(sec[j])))
    return float(sec[mine]), alts


def _incident(pb: Problem, index: dict[fx.Node, int]) -> dict[fx.Node, list[tuple[int, np.ndarray, bool]]]:
    """Each node's edges: the other end's index, the edge's matrix and whether the node
    is its destination (what :func:`_alternatives` prices a node's strategies with)."""
    incident: dict[fx.Node, list[tuple[int, np.ndarray, bool]]] = {n: [] for n in pb.nodes}
    for (u, v, _), (_, _, m) in zip(pb.edge_src, pb.problem.edges):
        incident[v].append((index[u], m, True))
        incident[u].append((index[v], m, False))
    return incident


def _redistributions(n: fx.Node, s: OpStrategy, ins: list[fx.Node], choice: dict[fx.Node, OpStrategy],
                     cm: CostModel, detail: bool) -> tuple[float, list[Redistribution]]:
    """The seconds of the redistributions on ``n``'s inputs (strategy ``s``) from their
    producers' choices, and with ``detail`` each one's steps."""
    reds: list[Redistribution] = []
    edge_comm = 0.0
    if n.op == "call_function" and n.target is not operator.getitem:
        for i, u in enumerate(ins):
            if u not in choice:
                continue
            src, dst = choice[u].outputs[0], s.inputs[i]
            if src != dst:
                # the forward alone where no gradient flows back, as searched
                sec = cm.redistribution(src, dst, info(u).out, dual(u, n))
                edge_comm += sec
                if detail:
                    reds.append(Redistribution(
                        u.name, fmt_placements(src), fmt_placements(dst),
                        [str(st) for st in plan_redistribution(src, dst, cm.mesh.shape)], sec))
    return edge_comm, reds


def assemble(gm: fx.GraphModule, mesh: MeshSpec, pb: Problem, choice: dict[fx.Node, OpStrategy],
             cm: CostModel, sol, opts: PlanOptions, searcher: str = "ilp",
             chosen: dict[fx.Node, int] | None = None, detail: bool = True) -> Plan:
    """Turn the solver's choice into a Plan with per-node prices and alternatives
    (``searcher`` names who chose: "ilp" or "drec"; ``chosen``: each choice's index in
    its node's strategies, when the caller has it).

    ``detail=False`` leaves out what only a plan that is shown or lowered reads: each
    input's redistribution steps, the alternatives and ``local_seconds``, the op's
    lowering in words and ``own_comm``.  Prices, placements and memory are the same.
    The joint search assembles its many candidates so (Megatron 145.6B: ~1,000 plans,
    ~8% of its search) and :func:`complete` fills in the one it chooses."""
    index = {n: i for i, n in enumerate(pb.nodes)}
    if chosen is None:
        chosen = {n: pb.strategies[n].index(s) for n, s in choice.items()}
    incident = _incident(pb, index) if detail else {n: [] for n in pb.nodes}
    nodes: dict[str, NodePlan] = {}
    layer_of = layer_keys(gm)
    compute = comm = sync = 0.0
    mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "buffers": 0.0}
    for n in pb.nodes:
        s = choice[n]
        ni = info(n)
        kind = _kind(n)
        own = pb.problem.node_costs[index[n]][chosen[n]]
        ins = pb.inputs.get(n) or tensor_inputs(n)
        edge_comm, reds = _redistributions(n, s, ins, choice, cm, detail)
        local, alts = _alternatives(n, pb, index, incident, chosen) if detail else (0.0, [])
        memory = pb.problem.node_memory[index[n]][chosen[n]]
        if kind == "param":
            sync += own
            pbytes, gbytes, obytes = param_state_split(n, s.outputs[0], mesh, opts.optimizer)
            mem["params"] += pbytes
            mem["grads"] += gbytes
            mem["optimizer"] += obytes
        elif kind == "buffer":
            mem["buffers"] += memory
        else:
            mem["activations"] += memory
            compute += own
        comm += edge_comm
        nodes[n.name] = NodePlan(
            name=n.name, op=_op_name(n), kind=kind,
            shape=[list(t.shape) for t in ni.outputs],
            inputs=[u.name for u in ins],
            in_placements=list(s.formatted[0]), out_placements=list(s.formatted[1]),
            compute=float(own if kind == "op" else 0.0), comm=float(edge_comm),
            memory=float(memory), param=ni.param, layer=layer_of.get(n, ""),
            flops=float(ni.flops), local_seconds=float(local),
            redistributions=reds, alternatives=alts,
            **(_lowering_fields(n, s, mesh, cm, kind) if detail else {}),
        )
    mem["total"] = sum(mem.values())
    plan = Plan(
        mesh=mesh, nodes=nodes, objective=float(sol.objective), compute_seconds=compute,
        comm_seconds=float(sol.objective) - compute - sync, grad_sync_seconds=sync, memory=mem,
        solver=SolverInfo(searcher=searcher, backend=sol.solver, status=str(sol.status),
                          gap=sol.gap, seconds=sol.wall_time, message=sol.message,
                          problem_nodes=len(pb.nodes), problem_edges=len(pb.problem.edges)),
        pins={k: (v if isinstance(v, str) else fmt_placements(tuple(v))) for k, v in opts.pins.items()},
    )
    if not detail:
        # the same assembly with the details, for complete() (no other field differs)
        setattr(plan, _DETAILS, lambda: assemble(gm, mesh, pb, choice, cm, sol, opts, searcher,
                                                 chosen).nodes)
    return plan


# the attribute of a plan assembled with detail=False that fills in its nodes' details
_DETAILS = "_autopar_node_details"


def complete(plan: Plan) -> Plan:
    """``plan`` with the per-node details a ``detail=False`` assembly left out, filled in
    place (each node's redistribution steps, alternatives, ``local_seconds``, lowering
    and ``own_comm``); any other plan as it is."""
    fill = plan.__dict__.pop(_DETAILS, None)
    if fill is not None:
        plan.nodes = fill()
    return plan


__all__ = ["assemble", "complete"]
