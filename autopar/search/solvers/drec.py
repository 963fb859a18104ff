r"""D-Rec: MindSpore-style double-recursive strategy search, one mesh axis per round.

The exact ILP (:mod:`autopar.search.solvers.ilp`) chooses among the *product* of per-axis
strategies, so its problem grows like ``nodes x strategies^2`` and explodes on meshes
such as ``(4, 4, 8, 8)``.  D-Rec never builds that product.  It decides the mesh axes
one at a time ("rounds"); in each round every op picks ONE 1-D strategy
(:class:`~autopar.sharding.rules.AxisStrategy`) for that axis, so the work per round is
``nodes x per-axis strategies`` and the whole search is linear in the graph.

Rounds and mesh axes
    MindSpore halves the device set ``log2(N)`` times; a round here cuts by a whole mesh
    axis (a 2-way axis is exactly one MindSpore halving, so a ``(2, 2, 2)`` mesh is its
    3-round, 8-device search).  Axes are taken slowest link first (lowest bandwidth, i.e.
    the inter-node axis of a hierarchical mesh): the first round sees whole tensors and
    gives its cheapest cut (typically the batch, whose only traffic is the gradient
    all-reduce) to the link where traffic is most expensive.  Local shapes shrink after
    every round: later rounds price and check divisibility on what is left.

One round
    1. *Simplify*: pointwise and view ops ("followers") are removed from the ordering and
       grouped with the op that produces their first input; parameters, inputs and
       buffers are grouped with their first consumer.  A group is decided as a unit.
    2. Every group, in topological order (or reverse, or MindSpore's descending weight),
       tries each valid 1-D strategy of its root op.  Followers then take the strategy
       that matches their producer's output (when that is valid for them; otherwise their
       cheapest valid one) and leaves take the placement their consumer asks for.  The
       group's price is its members' own costs plus the redistribution on every edge to a
       node already decided in this round; the cheapest strategy wins (first on ties, so
       the search is deterministic).
    3. *Refine* (production mode only): a few best-response sweeps re-decide each group
       against all its, now decided, neighbours; this repairs the greedy order's blind
       spot (an op decided early cannot see consumers decided later).

Cost modes (:class:`CostMode`)
    ``model``: :class:`~autopar.search.node_prices.CostModel`, the ILP's own prices, on the placements
    decided so far with the undecided axes replicated; plans are comparable with the ILP.
    ``mindspore``: MindSpore's own symbolic formulas (mindspore/ccsrc/frontend/parallel/
    auto_parallel/rec_core: rec_cost.{h,cc}, rec_partition.{h,cc}, rec_parse_graph.h), only
    to reproduce its documented example.  A matmul ``C[i,j] = A[i,k] B[k,j]`` with local
    sizes ``e`` (before this round) pays ``e_j e_k / 2 * 0.25`` to cut ``i``
    (MATMUL_MEM_COEF), ``e_i e_k / 2`` to cut ``j`` and ``e_i e_j / 2`` to cut ``k``; ties
    go to ``i``, then ``j``, then ``k``.  Redistribution is priced per op (CostRedis): for
    each op neighbour already decided this round (through followers; parameters and inputs
    are no nodes) whose cut of the tensor between them differs, ``16 x`` that tensor's
    local size.  MindSpore's eliminated ops (element-wise, bias, reductions, hence MSE/L1
    losses and broadcasting) follow their producer; cross-entropy losses are BatchParallel
    (cut the batch, weight +inf, no redistribution).  ``Order.REVERSE`` is MindSpore's
    TopologyOrder, ``Order.WEIGHT`` its older WeightOrder (GetMaxCostIn, ties later op
    first).  Every op must cut something each round (the device set is always halved).

Pins and memory
    A pinned node only considers 1-D strategies whose output matches the pin on that axis.
    If the finished plan exceeds the memory budget, the search is repeated with memory
    priced in (``cost + lam * bytes``, ``lam`` doubled until the plan fits); if even the
    leanest plan does not fit, :class:`~autopar.errors.PlanError` says by how much.

Code layout
    This module is the driver (round order, pins, memory pricing).  The options and
    results are in :mod:`autopar.search.solvers.drec_types`, the static graph view in
    :mod:`autopar.search.solvers.drec_graph`, the search state and one round in
    :mod:`autopar.search.solvers.drec_round`, the mindspore prices in
    :mod:`autopar.search.solvers.drec_mindspore`.  The options and results a caller
    passes and reads are importable from here too (this driver uses them all).

Example::

    >>> from autopar.search.solvers.drec import DRecOptions, drec_search   # doctest: +SKIP
    >>> result = drec_search(gm, mesh, CostModel(mesh), DRecOptions())  # doctest: +SKIP
    >>> result.choice[node]  # an OpStrategy per node, as the ILP would give  # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping

from torch import fx

from autopar.capture.ir import info
from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.plans.placement import Placements, fmt_placements, parse_placements, valid_for_shape
from autopar.search.node_prices import CostModel

# the search's parts live beside this driver: drec_types, drec_graph, drec_mindspore, drec_round
from autopar.search.solvers.drec_graph import _FOLLOWERS, _Graph, _plan_nodes
from autopar.search.solvers.drec_mindspore import _MS_ELIMINATED
from autopar.search.solvers.drec_round import _Search
from autopar.search.solvers.drec_types import (
    CostMode,
    DRecOptions,
    DRecResult,
    RoundInfo,
)
from autopar.search.solvers.problem import format_bytes
from autopar.sharding.rules import OpStrategy
from autopar.sharding.strategies import apply_pins

__all__ = ["axis_order", "drec_search", "resolve_pins"]

# Memory pricing: lam starts at (cost scale / memory scale) * this, and doubles.
_LAMBDA_START = 1e-3
_LAMBDA_STEPS = 40


def axis_order(mesh: MeshSpec) -> list[int]:
    """Mesh axes in round order: slowest link first (lowest bandwidth of any level the
    axis crosses), ties by axis index; axes of size 1 are skipped (nothing to cut)."""
    def slowest(a: int) -> float:
        levels = mesh.links[a].levels(mesh.shape[a])
        return min((link.beta for link, p in levels if p > 1), default=math.inf)
    return sorted((a for a in range(len(mesh.shape)) if mesh.shape[a] > 1),
                  key=lambda a: (slowest(a), a))


# ------------------------------------------------------------------------------- driver
_UNPINNED = OpStrategy((), (("unpinned",),))


def resolve_pins(gm: fx.GraphModule, pins: Mapping, mesh_shape: tuple[int, ...],
                 aliases: Mapping[str, list[str]]) -> dict[fx.Node, Placements]:
    """User pins (names, ``input:i``, globs) -> {node: placements}, with exactly the
    semantics and errors of :func:`autopar.sharding.strategies.apply_pins`.

    ``apply_pins`` filters candidate lists; here every node's list holds each pinned value
    plus a sentinel, so a node it pinned is the one whose sentinel is gone.
    """

    if not pins:
        return {}
    wants = list(dict.fromkeys(parse_placements(v) if isinstance(v, str) else tuple(v)
                               for v in pins.values()))
    lists = {n: [OpStrategy((), (w,)) for w in wants] + [_UNPINNED] for n in _plan_nodes(gm)}
    apply_pins(lists, pins, tuple(mesh_shape), aliases, gm)
    return {n: lst[0].outputs[0] for n, lst in lists.items() if _UNPINNED not in lst}


def _check_pins(g: _Graph, pins: Mapping[fx.Node, Placements], shape: tuple[int, ...]) -> None:
    for n, p in pins.items():
        if len(p) != len(shape):
            raise PlanError(f"pin on {n.name}: {len(p)} placements for a {len(shape)}-axis mesh")
        if n in g.index and not valid_for_shape(p, info(n).outputs[0].shape, shape):
            raise PlanError(f"pin {fmt_placements(p)} is not possible for {n.name} (shape "
                            f"{info(n).outputs[0].shape} on mesh {shape})")


def _one_run(g: _Graph, mesh: MeshSpec, cm: CostModel, opts: DRecOptions,
             pins: Mapping[fx.Node, Placements], lam: float, axes: Iterable[int]) -> tuple[_Search, list[RoundInfo]]:
    s = _Search(g, mesh, cm, opts, pins, lam)
    rounds = [s.run_round(a) for a in axes]
    return s, rounds


def drec_search(gm: fx.GraphModule, mesh: MeshSpec, cm: CostModel, opts: DRecOptions | None = None,
                pins: Mapping[fx.Node, Placements] | None = None,
                memory_budget: float | None = None) -> DRecResult:
    """Run D-Rec on an annotated graph; return an :class:`OpStrategy` per plan node.

    ``pins`` maps nodes to the placements they must output (resolved from user names by
    :func:`autopar.sharding.strategies.apply_pins`); ``memory_budget`` is bytes per device.  Raises
    :class:`PlanError` when a pin cannot be met or no plan found fits the budget.
    """
    opts = opts or DRecOptions()
    pins = dict(pins or {})
    t0 = time.perf_counter()
    shape = tuple(mesh.shape)
    followers = _FOLLOWERS | _MS_ELIMINATED if opts.cost_mode is CostMode.MINDSPORE else _FOLLOWERS
    g = _Graph(gm, shape, followers)
    _check_pins(g, pins, shape)
    axes = list(opts.axis_order) if opts.axis_order is not None else axis_order(mesh)
    s, rounds = _one_run(g, mesh, cm, opts, pins, 0.0, axes)
    mem = s.memory()
    lam, message = 0.0, f"D-Rec, {len(rounds)} rounds over mesh axes {axes}"
    if memory_budget is not None and mem > memory_budget and opts.cost_mode is CostMode.MODEL:
        # price memory in: lam converts bytes to seconds; start where memory is a small
        # share of the price and double until the plan fits
        cost = max(math.fsum(s.own(n) for n in g.nodes), 1e-12)
        lam = _LAMBDA_START * cost / max(mem, 1.0)
        best_mem = mem
        for _ in range(_LAMBDA_STEPS):
            s2, rounds2 = _one_run(g, mesh, cm, opts, pins, lam, axes)
            m2 = s2.memory()
            best_mem = min(best_mem, m2)
            if m2 <= memory_budget:
                s, rounds, mem = s2, rounds2, m2
                break
            lam *= 2.0
        else:
            raise PlanError(
                f"D-Rec found no plan within the memory budget {format_bytes(memory_budget)}: "
                f"the plain plan needs {format_bytes(mem)} per device and the leanest one it "
                f"found (memory priced in) {format_bytes(best_mem)}; raise the budget, use "
                f"more devices, or try search='ilp' for an exact answer")
        message += (f"; memory priced in (lam {lam:.3g} s/B) to fit the budget "
                    f"{format_bytes(memory_budget)}")
    choice = {n: s.full(n) for n in g.nodes}
    return DRecResult(choice, rounds, time.perf_counter() - t0, mem, lam, message)
