"""D-Rec's search state and one round: every node's 1-D strategy per mesh axis.

:class:`_Search` holds the mutable state of one D-Rec run and decides one mesh axis per
:meth:`_Search.run_round` (greedy pass, then refinement); the driver
(:func:`autopar.search.solvers.drec.drec_search`) runs it axis after axis.  It is separate from the
driver so the driver's memory-pricing loop and pin handling read on their own.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Mapping

import numpy as np
from torch import fx

from autopar.capture.grad_flow import dual
from autopar.capture.ir import info
from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.plans.placement import Placements, R, fmt_placements, is_partial
from autopar.search.node_prices import CostModel
from autopar.search.solvers.drec_graph import _Graph, _Group
from autopar.search.solvers.drec_mindspore import (
    _MATMULS,
    _MS_BATCH_PARALLEL,
    _MindSporePrices,
    _mm_kind,
)
from autopar.search.solvers.drec_types import CostMode, DRecOptions, Order, Refine, RoundInfo
from autopar.search.solvers.ilp import solve_ilp
from autopar.search.solvers.problem import StrategyProblem
from autopar.sharding.rules import (
    AxisStrategy,
    OpStrategy,
    combine_axes,
    divides,
    replicate_strategy,
)


class _Search(_MindSporePrices):
    """Mutable state of one D-Rec run: every node's 1-D strategy per mesh axis."""

    def __init__(self, g: _Graph, mesh: MeshSpec, cm: CostModel, opts: DRecOptions,
                 pins: Mapping[fx.Node, Placements], lam: float) -> None:
        self.g, self.mesh, self.cm, self.opts, self.pins, self.lam = g, mesh, cm, opts, pins, lam
        self.shape = tuple(mesh.shape)
        n_axes = len(self.shape)
        self.cur: dict[fx.Node, list[AxisStrategy]] = {}
        for n in g.nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                base = replicate_strategy(n)
            else:
                base = AxisStrategy((), (R,))
            self.cur[n] = [base] * n_axes
        self.decided: set[fx.Node] = set()
        self._full: dict[tuple, OpStrategy] = {}
        self._own: dict[tuple, float] = {}
        self._fits: dict[tuple, bool] = {}
        self.axis = 0

    # ---------------------------------------------------------------- state
    def full(self, n: fx.Node) -> OpStrategy:
        """The node's mesh strategy now (undecided axes replicated)."""
        key = (n, tuple(self.cur[n]))
        s = self._full.get(key)
        if s is None:
            s = combine_axes(self.cur[n])
            self._full[key] = s
        return s

    def set(self, n: fx.Node, s: AxisStrategy) -> None:
        """Give ``n`` the 1-D strategy ``s`` on the current axis."""
        row = self.cur[n]
        if row[self.axis] is not s:
            row = list(row)
            row[self.axis] = s
            self.cur[n] = row

    def fits(self, n: fx.Node, s: AxisStrategy) -> bool:
        """Divisibility and pins for ``s`` on the current axis (earlier axes as decided)."""
        pin = self.pins.get(n)
        if pin is not None and s.outputs[0] != pin[self.axis]:
            return False
        row = list(self.cur[n])
        row[self.axis] = s
        key = (n, tuple(row))
        ok = self._fits.get(key)
        if ok is None:
            ok = self._fits[key] = divides(n, combine_axes(row), self.shape)
        return ok

    # ---------------------------------------------------------------- prices
    def own(self, n: fx.Node) -> float:
        """The node's own price under its current strategy."""
        # the mindspore price is that of the current axis' cut: the axis is in the key
        key = (n, self.axis if self.opts.cost_mode is CostMode.MINDSPORE else -1, tuple(self.cur[n]))
        c = self._own.get(key)
        if c is None:
            c = self._own_price(n)
            self._own[key] = c
        return c

    def _own_price(self, n: fx.Node) -> float:
        s = self.full(n)
        if self.opts.cost_mode is CostMode.MINDSPORE:
            return self._ms_own(n)
        c = self.cm.node_cost(n, s)
        if n in self.g.to_output:  # outputs end up where the caller gets them, as the ILP prices them
            c += self.cm.output_cost(n, s)
        if self.lam:
            c += self.lam * self.cm.node_memory(n, s)
        return c

    def edge(self, u: fx.Node, v: fx.Node, i: int) -> float:
        """Redistribution price of edge ``u -> v`` (input ``i`` of ``v``)."""
        if i < 0:
            return 0.0  # getitem takes its producer's placement by construction
        if self.opts.cost_mode is CostMode.MINDSPORE:
            return 0.0  # priced per op against its op neighbours: see _ms_redis
        src, dst = self.full(u).outputs[0], self.full(v).inputs[i]
        return self.cm.redistribution(src, dst, info(u).out, dual(u, v))

    def node_price(self, n: fx.Node, inside: set[fx.Node] | None = None) -> float:
        """Own price plus edges to decided neighbours (or to ``inside`` members)."""
        total = self.own(n)
        inside = inside or set()
        for u, i in self.g.in_edges[n]:
            if u in self.decided or u in inside:
                total += self.edge(u, n, i)
        for v, i in self.g.out_edges[n]:
            if v in self.decided or v in inside:
                total += self.edge(n, v, i)
        return total

    # ---------------------------------------------------------------- one group
    def _getitem(self, n: fx.Node) -> AxisStrategy:
        src = self.cur[n.args[0]][self.axis]
        return AxisStrategy((), (src.outputs[n.args[1]],))

    def _leaf_choice(self, n: fx.Node, set_now: set[fx.Node]) -> AxisStrategy:
        """What the first decided consumer asks for, if valid (Partial -> Replicate)."""
        a = self.axis
        for v, i in self.g.out_edges[n]:
            if v in set_now or v in self.decided:
                want = self.full(v).inputs[i][a]
                if is_partial(want):
                    want = R
                for c in self.g.cands[n]:
                    if c.outputs[0] == want and self.fits(n, c):
                        return c
                break
        pin = self.pins.get(n)
        for c in self.g.cands[n]:
            if (pin is None or c.outputs[0] == pin[a]) and self.fits(n, c):
                return c
        return self.g.cands[n][0]

    def _follower_choice(self, n: fx.Node, set_now: set[fx.Node]) -> AxisStrategy:
        """The valid candidate matching the producer's output, unless another valid one is
        strictly cheaper against everything decided (the fallback)."""
        if n.target is operator.getitem:
            return self._getitem(n)
        p = self.g.producer(n)
        want = self.cur[p][self.axis].outputs[0] if p is not None else None
        pos = next((i for u, i in self.g.in_edges[n] if u is p), None)
        best, best_cost, best_match = None, math.inf, False
        for c in self.g.cands[n]:
            if not self.fits(n, c):
                continue
            self.set(n, c)
            cost = self.node_price(n, set_now)
            match = pos is not None and c.inputs[pos] == want
            if cost < best_cost or (cost == best_cost and match and not best_match) or best is None:
                best, best_cost, best_match = c, cost, match
        if best is None:  # only a pin can exclude Replicate, which always divides
            raise PlanError(f"D-Rec: no strategy of {n.name} fits mesh axis {self.axis}"
                            + self._pin_hint(n))
        return best

    def _resolve(self, grp: _Group, root_choice: AxisStrategy) -> float:
        """Set every member for ``root_choice`` of the root; return the group's price."""
        set_now: set[fx.Node] = set()
        for m in grp.members:
            if m is grp.root and not self.g.is_leaf(m):
                c = root_choice
            elif self.g.is_leaf(m):
                c = self._leaf_choice(m, set_now) if m is not grp.root else root_choice
            else:
                c = self._follower_choice(m, set_now)
            self.set(m, c)
            set_now.add(m)
        total = 0.0
        if self.opts.cost_mode is CostMode.MINDSPORE:
            return math.fsum(self.own(m) for m in grp.members) + self._ms_redis(grp)
        for m in grp.members:
            total += self.own(m)
            for u, i in self.g.in_edges[m]:
                if u in set_now or u in self.decided:
                    total += self.edge(u, m, i)
            for v, i in self.g.out_edges[m]:
                if v in self.decided and v not in set_now:
                    total += self.edge(m, v, i)
        return total

    def root_options(self, grp: _Group) -> list[AxisStrategy]:
        """Valid 1-D strategies of the group's root on the current axis."""
        if grp.root.target is operator.getitem:
            return [self._getitem(grp.root)]
        opts = [c for c in self.g.cands[grp.root] if self.fits(grp.root, c)]
        if not opts:
            raise PlanError(f"D-Rec: no strategy of {grp.root.name} fits mesh axis {self.axis} "
                            f"(size {self.shape[self.axis]})" + self._pin_hint(grp.root))
        return opts

    def _pin_hint(self, n: fx.Node) -> str:
        pin = self.pins.get(n)
        return "" if pin is None else f" with its pin {fmt_placements(pin)}"

    def decide(self, grp: _Group) -> bool:
        """Pick the group's cheapest root strategy; return whether anything changed."""
        before = {m: self.cur[m][self.axis] for m in grp.members}
        options = self.root_options(grp)
        if self.opts.cost_mode is CostMode.MINDSPORE and grp.root.target in _MATMULS:
            # ChoseStr takes the first minimum of (i, j, k): try them in that order
            options = sorted(options, key=lambda c: _mm_kind(grp.root, c.inputs, c.outputs[0]))
        if grp.root in self.decided:
            # a refinement sweep: the current choice is tried first and kept on ties, so
            # sweeps only ever lower the price and stop
            current = self.cur[grp.root][self.axis]
            options = [current] + [c for c in options if c != current]
        best, best_cost = None, math.inf
        for c in options:
            cost = self._resolve(grp, c)
            if best is None or cost < best_cost * (1 - 1e-12):
                best, best_cost = c, cost
        self._resolve(grp, best)
        self.decided.update(grp.members)
        return any(self.cur[m][self.axis] != before[m] for m in grp.members)

    def weight(self, grp: _Group) -> float:
        """The op weight of :attr:`Order.WEIGHT`.

        Mindspore mode: MindSpore's GetWeights (rec_partition.cc): a matmul's dearest cut
        (CostMatMul::GetMaxCostIn), a loss (BatchParallel) ``+inf``, any other op 0.  Model
        mode: the root's cheapest cut, its own cost only.
        """
        if self.opts.cost_mode is CostMode.MINDSPORE:
            root = grp.root
            if root.target in _MS_BATCH_PARALLEL:
                return math.inf
            if root.target in _MATMULS:
                return max(self._ms_cut_costs(*self._ms_dims(root)))
            return 0.0
        row = self.cur[grp.root]
        costs = []
        for c in self.root_options(grp):
            self.set(grp.root, c)
            costs.append(self.own(grp.root))
        self.cur[grp.root] = row
        finite = [c for c in costs if math.isfinite(c)]
        return min(finite) if finite else 0.0

    def run_round(self, axis: int) -> RoundInfo:
        """Decide every group on ``axis``: greedy pass, then refinement sweeps."""
        t0 = time.perf_counter()
        self.axis = axis
        self.decided = set()
        groups = list(self.g.groups)
        if self.opts.order is Order.REVERSE:
            groups.reverse()
        elif self.opts.order is Order.WEIGHT:
            w = {id(grp): self.weight(grp) for grp in groups}
            if self.opts.cost_mode is CostMode.MINDSPORE:
                # SortByWeight: (weight, index) ascending, read backwards -> on ties the
                # later op first
                groups.sort(key=lambda grp: (-w[id(grp)], -self.g.index[grp.root]))
            else:
                groups.sort(key=lambda grp: -w[id(grp)])  # stable: graph order on ties
        for grp in groups:
            self.decide(grp)
        refined = 0
        refine = self.opts.refine if self.opts.cost_mode is CostMode.MODEL else Refine.NONE
        if refine is Refine.SWEEPS:
            for _ in range(self.opts.refine_sweeps):
                changed = sum(self.decide(grp) for grp in groups)
                refined += changed
                if not changed:
                    break
        elif refine is Refine.EXACT:
            refined = self.exact_round()
        return RoundInfo(axis, self.shape[axis], time.perf_counter() - t0, refined)

    def round_price(self) -> float:
        """Price of the current axis' choices (own costs plus every edge)."""
        total = 0.0
        for n in self.g.nodes:
            total += self.own(n)
            for u, i in self.g.in_edges[n]:
                total += self.edge(u, n, i)
        return total

    def exact_round(self) -> int:
        """Solve this axis' 1-D problem exactly; adopt it when cheaper than the greedy
        choice.  Returns how many nodes changed."""

        nodes = self.g.nodes
        greedy = {n: self.cur[n][self.axis] for n in nodes}
        cands: dict[fx.Node, list[AxisStrategy]] = {}
        for n in nodes:
            if n.target is operator.getitem:
                src = cands[n.args[0]]
                cands[n] = [AxisStrategy((), (c.outputs[n.args[1]],)) for c in src]
            else:
                cands[n] = [c for c in self.g.cands[n] if self.fits(n, c)]
                if not cands[n]:
                    return 0  # a pin leaves nothing here: keep the greedy answer
        costs, mems = [], []
        for n in nodes:
            row = []
            for c in cands[n]:
                self.set(n, c)
                row.append(self.own(n))
            costs.append(np.array(row))
            mems.append(np.zeros(len(row)))
        index = {n: i for i, n in enumerate(nodes)}
        edges = []
        for v in nodes:
            for u, i in self.g.in_edges[v]:
                if i < 0:
                    m = np.full((len(cands[u]), len(cands[v])), np.inf)
                    np.fill_diagonal(m, 0.0)
                else:
                    m = np.empty((len(cands[u]), len(cands[v])))
                    for a, cu in enumerate(cands[u]):
                        self.set(u, cu)
                        for b, cv in enumerate(cands[v]):
                            self.set(v, cv)
                            m[a, b] = self.edge(u, v, i)
                edges.append((index[u], index[v], m))
        for n in nodes:
            self.set(n, greedy[n])
        before = self.round_price()
        try:
            sol = solve_ilp(StrategyProblem(costs, mems, edges), time_limit=10.0)
        except (ValueError, TimeoutError):
            return 0
        if not sol.objective < before * (1 - 1e-12):
            return 0
        for n, j in zip(nodes, sol.choice):
            self.set(n, cands[n][j])
        return sum(self.cur[n][self.axis] != greedy[n] for n in nodes)

    def memory(self) -> float:
        """Per-device bytes of the current plan, as the cost model counts them."""
        return math.fsum(self.cm.node_memory(n, self.full(n)) for n in self.g.nodes)
