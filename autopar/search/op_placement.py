"""Build the strategy-selection problem from the annotated graph, solve it, and turn
the choice into a :class:`~autopar.plans.Plan`.

Problem: one variable per tensor node (its strategy), node costs from
:class:`~autopar.search.node_prices.CostModel`, one edge per (producer, consumer input) priced by
the redistribution between the producer's output and the consumer's required input,
and the memory budget over parameters, gradients, optimizer state and activations.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
from torch import fx
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopar.capture.grad_flow import dual
from autopar.capture.ir import info, tensor_inputs
from autopar.capture.layers import layers
from autopar.capture.layers import layers as _layers
from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.log import report
from autopar.plans.data import Plan
from autopar.plans.decisions import PlanOptions, prices
from autopar.plans.placement import graph_batch, parse_placements, returned_placement
from autopar.search.assemble import assemble
from autopar.search.fusion import fuse
from autopar.search.node_prices import CostModel
from autopar.search.solvers import bounds
from autopar.search.solvers.cluster import solve_clustered
from autopar.search.solvers.cluster_detect import (
    Clustering,
    find_clusters,
    shared_pricing,
)
from autopar.search.solvers.drec import drec_search, resolve_pins
from autopar.search.solvers.drec_graph import _plan_nodes
from autopar.search.solvers.drec_types import DRecOptions
from autopar.search.solvers.ilp import solve_ilp
from autopar.search.solvers.problem import (
    InfeasibleError,
    Solution,
    SolveStatus,
    StrategyProblem,
    evaluate,
)
from autopar.sharding.rules import OpStrategy, RuleCtx, axis_strategies
from autopar.sharding.rules.attention import restrict_attention
from autopar.sharding.strategies import apply_pins, enumerate_strategies


@dataclass
class Problem:
    """The solver's problem plus the bookkeeping to read its answer back."""

    nodes: list[fx.Node]
    strategies: dict[fx.Node, list[OpStrategy]]
    problem: StrategyProblem
    edge_src: list[tuple[fx.Node, fx.Node, int]]  # (producer, consumer, input index)
    # each node's tensor inputs, read once here for every plan assembled from this problem
    # (the joint search assembles up to four per candidate)
    inputs: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)


def build_problem(gm: fx.GraphModule, mesh: MeshSpec, strategies: dict[fx.Node, list[OpStrategy]],
                  cm: CostModel, budget: float | None,
                  share: dict[fx.Node, fx.Node] | None = None) -> Problem:
    """Assemble :class:`StrategyProblem` arrays (see module docstring).

    ``share`` maps a node to a twin priced identically (a repeated layer's node and its
    counterpart in the first identical layer, :func:`autopar.search.solvers.cluster_detect.shared_pricing`):
    the twin's arrays are reused, so a deep stack of identical layers is priced once."""
    share = share or {}
    nodes = list(strategies)
    index = {n: i for i, n in enumerate(nodes)}
    costs, mems = [], []
    priced: dict[fx.Node, tuple[np.ndarray, np.ndarray]] = {}
    matrices: dict[tuple[fx.Node, fx.Node, int], np.ndarray] = {}
    tables = cm.matrix_tables()
    for n in nodes:
        if share.get(n) in priced:
            c, m = priced[share[n]]
            costs.append(c)
            mems.append(m)
            continue
        c = _node_costs(n, strategies[n], cm)
        costs.append(c)
        mems.append(np.array([cm.node_memory(n, s) for s in strategies[n]], dtype=np.float64))
        priced[n] = (c, mems[-1])
    edges, edge_src = [], []
    inputs = {v: tensor_inputs(v) for v in nodes}
    for v in nodes:
        if v.op == "call_function" and v.target is operator.getitem:
            u = v.args[0]
            k = len(strategies[u])
            m = np.full((k, k), np.inf)
            np.fill_diagonal(m, 0.0)
            edges.append((index[u], index[v], m))
            edge_src.append((u, v, -1))
            continue
        for i, u in enumerate(inputs[v]):
            if u not in index:
                continue
            back = dual(u, v)
            key = (share.get(u, u), share.get(v, v), i, back)
            m = matrices.get(key)
            if m is None:
                m = matrices[key] = edge_matrix(
                    [a.outputs[0] for a in strategies[u]], [b.inputs[i] for b in strategies[v]],
                    info(u).out, cm, tables, dual=back)
            edges.append((index[u], index[v], m))
            edge_src.append((u, v, i))
    prob = StrategyProblem(node_costs=costs, node_memory=mems, edges=edges,
                           memory_budget=budget, names=[n.name for n in nodes])
    return Problem(nodes, strategies, prob, edge_src, inputs)


def edge_matrix(src: list, dst: list, t, cm: CostModel, tables: dict | None = None,
                dual: bool = True) -> np.ndarray:
    """Redistribution prices from each of ``src`` (a producer's output placements) to
    each of ``dst`` (a consumer input's), for tensor ``t``.  Strategies repeat
    placements (a matmul's dozens of strategies leave its output in a few layouts), so
    only the distinct pairs are priced and the matrix is gathered from that table with
    numpy; ``tables`` keeps the table per (distinct sources, distinct targets, shape,
    dtype), shared by every edge carrying the same tensor between the same layouts.
    ``dual=False``: the forward alone, where no gradient flows back through the edge
    (:func:`autopar.capture.grad_flow.dual`; a price is the forward's and its equal dual's)."""
    us, si = _distinct(src)
    ud, di = _distinct(dst)
    key = (us, ud, t.shape, t.dtype)
    table = None if tables is None else tables.get(key)
    if table is None:
        table = cm.redistribution_matrix(us, ud, t)
        if tables is not None:
            tables[key] = table
    m = table[np.ix_(si, di)]
    return m if dual else 0.5 * m


def _distinct(items: list) -> tuple[tuple, np.ndarray]:
    """The distinct items in first-seen order and each item's index among them."""
    first: dict = {}
    idx = [first.setdefault(x, len(first)) for x in items]
    return tuple(first), np.asarray(idx, dtype=np.intp)


def _node_costs(n: fx.Node, strategies: list[OpStrategy], cm: CostModel) -> np.ndarray:
    """Node ``n``'s own price under each strategy."""
    c = np.array([cm.node_cost(n, s) for s in strategies], dtype=np.float64)
    # a model output must end up where the caller gets it (replicated, or its rows
    # per data-parallel rank under batch="local"): price that here
    if any(user.op == "output" for user in n.users):
        c = c + np.array([cm.output_cost(n, s) for s in strategies])
    return c


def _drec_bound(gm: fx.GraphModule, mesh: MeshSpec, cm: CostModel, aliases: dict,
                opts: PlanOptions, chosen: dict[fx.Node, OpStrategy], own: list[np.ndarray]) -> float:
    """A lower bound on the best plan for a D-Rec plan's gap (:func:`autopar.search.solvers.bounds.
    node_bound`): every node's least own price over the strategies the ILP would choose
    among (pins applied) and D-Rec's own (``own``: its chosen price per node). Edges are
    not priced: that is what makes the ILP too big where D-Rec runs; identical layers are
    priced once."""
    strategies = enumerate_strategies(gm, tuple(mesh.shape))
    apply_pins(strategies, opts.pins, tuple(mesh.shape), aliases, gm)
    share = shared_pricing(gm, strategies)
    least: dict[fx.Node, float] = {}
    out = []
    for n, c in zip(chosen, own):
        key = share.get(n, n)
        if key not in least:
            st = strategies.get(key) or []
            least[key] = float(_node_costs(key, st, cm).min()) if st else math.inf
        out.append(np.array([min(least[key], float(c[0]))]))
    return bounds.node_bound(out)


def _solve(problem: StrategyProblem, time_limit: float, clusters: Clustering | None = None):
    """Exact shortcut first: the optimum without the memory budget (leaf/chain
    elimination, no MIP for tree-like graphs) is also optimal with it whenever it fits;
    only when it does not is the budgeted MIP solved.  With repeated layers
    (``clusters``) the clustered solver runs instead (autopar/search/solvers/cluster.py)."""
    if clusters is not None:
        try:
            sol = solve_clustered(problem, clusters, time_limit)
        except InfeasibleError as e:
            raise PlanError(f"no plan fits the memory budget: {e}") from e
        if sol is not None:
            return sol
    budget = problem.memory_budget
    t0 = time.perf_counter()
    if budget is not None:
        free = dataclasses.replace(problem, memory_budget=None)
        sol = solve_ilp(free, time_limit=time_limit)
        if evaluate(problem, sol.choice)[1] <= budget and str(sol.status) == "optimal":
            sol.message += "; fits the memory budget"
            return sol
        time_limit = max(1.0, time_limit - (time.perf_counter() - t0))
    try:
        return solve_ilp(problem, time_limit=time_limit)
    except InfeasibleError as e:
        raise PlanError(f"no plan fits the memory budget: {e}") from e


class Searcher(StrEnum):
    """Which search makes the plan (``PlanOptions.search``)."""

    AUTO = "auto"
    """The ILP when its problem is small enough to build and solve in the time limit
    (:func:`choose_searcher`), else D-Rec."""
    ILP = "ilp"
    """Exact: every node's full mesh strategy, solved by autopar/search/solvers/ilp.py."""
    DREC = "drec"
    """Fast: one mesh axis per round, one 1-D strategy per op (autopar/search/solvers/drec.py)."""


# The ILP's build cost is pricing every edge matrix entry (k_u x k_v redistributions)
# in Python, ~10 us each when measured (GPT 4 layers on (2, 2): 1.6 s for ~160k entries),
# and the solve after presolve is far cheaper on these chain-like graphs.  ``auto`` takes
# the ILP while the predicted build stays under this share of the time limit.
_ILP_SECONDS_PER_ENTRY = 1e-5
_ILP_SHARE_OF_LIMIT = 0.5


def ilp_size(gm: fx.GraphModule, mesh_shape: tuple[int, ...]) -> tuple[int, int]:
    """(sum of strategies over nodes, sum of edge matrix entries) the ILP would build,
    estimated without enumerating the product: a node with ``s`` 1-D strategies gets
    ``s ** axes`` (an upper bound: divisibility prunes some), axes of size 1 excluded."""

    axes = sum(1 for n in mesh_shape if n > 1)
    ctx = RuleCtx(tuple(mesh_shape))
    k: dict[fx.Node, int] = {}
    entries = 0
    for n in _plan_nodes(gm):
        if n.op == "call_function" and n.target is operator.getitem:
            k[n] = k.get(n.args[0], 1)
            entries += k[n] * k[n]
            continue
        if n.op == "call_function":
            k[n] = len(axis_strategies(n, ctx)) ** axes
            entries += sum(k[n] * k[u] for u in tensor_inputs(n) if u in k)
        else:
            k[n] = (info(n).out.ndim + 1) ** axes if info(n).param or n.op == "placeholder" else 1
    return sum(k.values()), entries


def choose_searcher(gm: fx.GraphModule, mesh: MeshSpec, opts: PlanOptions) -> tuple[Searcher, str]:
    """The searcher to run and why (for the plan's message).

    ``auto``: the ILP when its predicted build time (edge matrix entries x
    ``_ILP_SECONDS_PER_ENTRY``) is under half the time limit, else D-Rec.
    """
    try:
        want = Searcher(str(opts.search).lower())
    except ValueError:
        raise PlanError(f"unknown search {opts.search!r}; expected one of "
                        f"{', '.join(s.value for s in Searcher)}") from None
    if opts.context_parallel is not None:
        # D-Rec decides axis by axis and cannot restrict a mesh strategy's form
        if want is Searcher.DREC:
            raise PlanError("context_parallel= restricts the ILP's strategies; use search='ilp' "
                            "or 'auto' with it (D-Rec chooses the attention's split itself)")
        return Searcher.ILP, "context_parallel= is set: the ILP"
    if want is not Searcher.AUTO:
        return want, ""
    nodes, entries = ilp_size(gm, tuple(mesh.shape))
    # identical repeated layers are priced once (shared pricing) and solved once
    # (clustering): only one layer's share of the entries costs build time
    reps = [lay for lay in _layers(gm) if lay.repeated]
    total = sum(len(lay.nodes) for lay in _layers(gm))
    if len(reps) > 1 and total:
        in_reps = sum(len(lay.nodes) for lay in reps)
        entries *= (total - in_reps + in_reps / len(reps)) / total
    predicted = entries * _ILP_SECONDS_PER_ENTRY
    limit = opts.choose_limit if opts.choose_limit is not None else opts.time_limit
    if predicted <= _ILP_SHARE_OF_LIMIT * limit:
        return Searcher.ILP, f"auto: ILP (~{entries:.3g} edge entries, ~{predicted:.2g} s to build)"
    return Searcher.DREC, (f"auto: D-Rec (the ILP would price ~{entries:.3g} edge entries, "
                           f"~{predicted:.2g} s, over half the {limit:g} s limit)")


@prices("batch")
def cost_model(gm: fx.GraphModule, mesh: MeshSpec, opts: PlanOptions) -> CostModel:
    """The cost model of one planning call: outputs priced as ``opts.batch`` returns them,
    the graph as it runs (fused where ``opts.compile``)."""
    local = graph_batch(gm) if opts.batch == "local" else None
    pinned = any(str(k).startswith("input:") for k in opts.pins)
    return CostModel(mesh, optimizer=opts.optimizer, local_rows=local, arrival_tie=not pinned,
                     fusion=fuse(gm) if opts.compile else None)


def local_axes(gm: fx.GraphModule, plan: Plan) -> list[int] | None:
    """Under ``batch="local"``: the mesh axes that split the rows of the first batch-shaped
    model output as it is returned (:func:`autopar.plans.placement.returned_placement`); None
    when no output has the batch as dim 0."""
    rows = graph_batch(gm)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in pytree.tree_leaves(out.args[0]):
        np_ = plan.nodes.get(a.name) if isinstance(a, fx.Node) else None
        if np_ is None or len(np_.shape) != 1 or not np_.shape[0] or np_.shape[0][0] != rows:
            continue
        pl = returned_placement(parse_placements(np_.out_placements[0]), np_.shape[0], rows)
        return [i for i, p in enumerate(pl) if isinstance(p, Shard)]
    return None


def make_plan_drec(gm: fx.GraphModule, mesh: MeshSpec, aliases: dict, opts: PlanOptions,
                   why: str = "") -> Plan:
    """Plan with D-Rec, then price its choice exactly as the ILP's (a one-strategy
    problem per node), so objective, compute/comm/grad-sync and memory mean the same."""

    t0 = time.perf_counter()
    cm = cost_model(gm, mesh, opts)
    budget = opts.budget_for(mesh)
    pins = resolve_pins(gm, opts.pins, tuple(mesh.shape), aliases)
    report(f"D-Rec search over {len(gm.graph.nodes)} graph nodes, one mesh axis at a time")
    res = drec_search(gm, mesh, cm, DRecOptions(), pins, budget)
    t1 = time.perf_counter()
    pb = build_problem(gm, mesh, {n: [s] for n, s in res.choice.items()}, cm, budget)
    choice = [0] * len(pb.nodes)
    objective, _ = evaluate(pb.problem, choice)
    if not math.isfinite(objective):
        raise PlanError("D-Rec found no finite-cost plan (contradictory pins?)")
    g = bounds.gap(objective, _drec_bound(gm, mesh, cm, aliases, opts, res.choice, pb.problem.node_costs))
    bound_text = "gap unknown" if g is None else f"gap at most {100 * g:.1f}% (node-price bound)"
    sol = Solution(choice, objective, SolveStatus.FEASIBLE, g, "drec", res.seconds,
                   res.message + f"; {bound_text}" + (f"; {why}" if why else ""))
    plan = assemble(gm, mesh, pb, res.choice, cm, sol, opts, searcher=Searcher.DREC.value)
    plan.timings.update(solve=t1 - t0, enumerate_and_price=time.perf_counter() - t1)
    return plan


def make_plan(gm: fx.GraphModule, mesh: MeshSpec, aliases: dict, opts: PlanOptions) -> Plan:
    """Enumerate, price, solve and assemble the plan for an annotated graph
    (``opts.search`` picks the ILP, D-Rec, or one of them by problem size)."""
    return make_plans(gm, mesh, aliases, opts)[0]


SYNC_WEIGHTS = (0.5, 0.25, 0.0)
"""The fractions of each gradient all-reduce left exposed in :func:`make_plans`' variants
(1.0, fully charged, is the plan itself)."""


def _sync_weighted(pb: Problem, w: float) -> StrategyProblem:
    """``pb``'s problem with every parameter's gradient all-reduce charged at ``w`` of its
    price, the rest taken as hidden behind backward (a parameter's node cost is nothing
    else: :meth:`CostModel.node_cost`)."""
    costs = [c * w if n.op == "get_attr" and info(n).param is not None else c
             for n, c in zip(pb.nodes, pb.problem.node_costs)]
    return dataclasses.replace(pb.problem, node_costs=costs)


def make_plans(gm: fx.GraphModule, mesh: MeshSpec, aliases: dict, opts: PlanOptions,
               sync_variants: bool = False) -> list[Plan]:
    """:func:`make_plan`'s plan, and with ``sync_variants`` (ILP only) the distinct plans
    solved with the gradient all-reduces charged at :data:`SYNC_WEIGHTS` of their price
    (:func:`make_weighted_plans` without the weights)."""
    return [p for _, p in make_weighted_plans(gm, mesh, aliases, opts, sync_variants)]


def make_weighted_plans(gm: fx.GraphModule, mesh: MeshSpec, aliases: dict, opts: PlanOptions,
                        sync_variants: bool = False,
                        weights: tuple[float, ...] | None = None,
                        detail: bool = True) -> list[tuple[float, Plan]]:
    """(sync weight, plan) pairs: the plan as priced (weight 1.0) and, with
    ``sync_variants`` (ILP only), the distinct plans solved with the gradient
    all-reduces charged at :data:`SYNC_WEIGHTS` of their price.  ``weights`` keeps
    only those (the joint search re-plans one estimate's variant at full depth);
    ``detail=False``: plans without the per-node details only a shown or lowered plan
    reads (:func:`autopar.search.assemble.complete` fills them in).

    The ILP charges each parameter's gradient sync in full, while the joint step model
    (:mod:`autopar.search.stages.pipeline_step`) overlaps the buckets with backward and exposes only
    the tail. Where bf16 compute makes communication matter, the two disagree: the ILP
    shards weights over data-parallel axes to save an all-reduce the step would have
    hidden, while charging nothing replicates every weight (which may not fit). The
    joint search prices every variant with its step model, ZeRO and recomputation and
    keeps the fastest; the problem is priced once and every plan carries its true (fully
    charged) objective."""
    searcher, why = choose_searcher(gm, mesh, opts)
    if searcher is Searcher.DREC:
        return [(1.0, make_plan_drec(gm, mesh, aliases, opts, why))]
    t0 = time.perf_counter()
    report(f"pricing the strategies of {len(gm.graph.nodes)} graph nodes on mesh "
           f"{'x'.join(map(str, mesh.shape))}")
    strategies = enumerate_strategies(gm, tuple(mesh.shape))
    apply_pins(strategies, opts.pins, tuple(mesh.shape), aliases, gm)
    try:
        restrict_attention(strategies, opts.context_parallel, tuple(mesh.shape))
    except ValueError as e:
        raise PlanError(str(e)) from None
    cm = cost_model(gm, mesh, opts)
    budget = opts.budget_for(mesh)
    lays = layers(gm)  # one grouping for shared pricing and clustering: not free at depth
    pb = build_problem(gm, mesh, strategies, cm, budget, shared_pricing(gm, strategies, lays))
    t1 = time.perf_counter()
    report(f"solving the placement ILP: {len(pb.nodes)} nodes, {len(pb.problem.edges)} edges, "
           f"limit {opts.time_limit:.0f} s")
    # the clusters depend on the problem's edges and strategy counts only, which the
    # sync-weighted variants below share: found once
    clusters = find_clusters(gm, pb.nodes, pb.strategies, pb.problem, lays)
    plans: list[tuple[float, Plan]] = []
    seen = []
    todo = (1.0, *SYNC_WEIGHTS) if sync_variants else (1.0,)
    for w in todo if weights is None else tuple(x for x in todo if x in weights):
        t3 = time.perf_counter()
        sol = _solve(pb.problem if w == 1.0 else _sync_weighted(pb, w), opts.time_limit, clusters)
        if w == 1.0 and not math.isfinite(sol.objective):
            _finish(gm, mesh, pb, sol, cm, opts, why, t1 - t0, 0.0)  # raises: no finite plan
        if sol.choice in seen or not math.isfinite(sol.objective):
            continue
        seen.append(sol.choice)
        if w != 1.0:
            sol.objective = evaluate(pb.problem, sol.choice)[0]  # the true, fully charged price
            sol.message += f"; solved with the gradient all-reduces charged at {w:g} of their price"
        plans.append((w, _finish(gm, mesh, pb, sol, cm, opts, why, t1 - t0,
                                 time.perf_counter() - t3, detail)))
    return plans


def _finish(gm: fx.GraphModule, mesh: MeshSpec, pb: Problem, sol, cm: CostModel, opts: PlanOptions,
            why: str, price_s: float, solve_s: float, detail: bool = True) -> Plan:
    """Assemble one ILP solution into a Plan (finite objective, timings, the searcher's
    why; ``detail``: :func:`autopar.search.assemble.assemble`'s)."""
    if not math.isfinite(sol.objective):
        raise PlanError("the search found no finite-cost plan (contradictory pins?)")
    choice = {n: pb.strategies[n][c] for n, c in zip(pb.nodes, sol.choice)}
    plan = assemble(gm, mesh, pb, choice, cm, sol, opts, chosen=dict(zip(pb.nodes, sol.choice)),
                    detail=detail)
    if why:
        plan.solver.message += f"; {why}"
    plan.timings.update(enumerate_and_price=price_s, solve=solve_s)
    return plan
