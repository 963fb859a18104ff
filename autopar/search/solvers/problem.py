"""Generic strategy-selection problem: the input and output of every search backend.

A problem is a graph. Node ``i`` has ``k_i`` candidate strategies, each with a cost
``c_i[a]`` (seconds) and a memory footprint ``m_i[a]`` (bytes). An edge ``(u, v, R)``
charges ``R[a, b]`` seconds of resharding when ``u`` picks ``a`` and ``v`` picks ``b``;
``R[a, b] = inf`` forbids the pair. A plan picks one strategy per node::

    minimise   sum_i c_i[x_i] + sum_(u,v,R) R[x_u, x_v]
    subject to sum_i m_i[x_i] <= memory_budget      (when a budget is given)

Example::

    >>> import numpy as np
    >>> p = StrategyProblem([np.array([1.0, 2.0])], [np.array([8.0, 4.0])], [], 6.0)
    >>> evaluate(p, [1])
    (2.0, 4.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

__all__ = [
    "InfeasibleError",
    "Solution",
    "SolveStatus",
    "StrategyProblem",
    "evaluate",
    "format_bytes",
]


@dataclass
class StrategyProblem:
    """Pick one strategy per node minimising node plus edge (resharding) cost.

    ``node_costs[i]`` and ``node_memory[i]`` are float vectors of length ``k_i >= 1``;
    ``edges`` holds ``(u, v, R)`` with ``R.shape == (k_u, k_v)``, finite or ``+inf``
    (forbidden pair). Several edges between the same pair are allowed and add up.
    ``memory_budget`` bounds the sum of the chosen ``node_memory`` entries; ``names``
    labels nodes in error messages.
    """

    node_costs: list[np.ndarray]
    node_memory: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]]
    memory_budget: float | None = None
    names: list[str] | None = None

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the graph."""
        return len(self.node_costs)

    def name(self, i: int) -> str:
        """Human-readable label of node ``i`` for messages."""
        if self.names is not None and i < len(self.names):
            return f"{self.names[i]!r} (node {i})"
        return f"node {i}"

    def validate(self) -> None:
        """Check shapes and values; raise ``ValueError`` naming the first offending entry."""
        n = self.num_nodes
        if len(self.node_memory) != n:
            raise ValueError(
                f"node_costs has {n} nodes but node_memory has {len(self.node_memory)}"
            )
        if self.names is not None and len(self.names) != n:
            raise ValueError(f"names has {len(self.names)} entries for {n} nodes")
        # shapes entry by entry, values all at once (numpy per entry was most of the
        # check, and the joint search solves ~1,000 problems); the first offending entry
        # is named either way
        costs = [np.asarray(c) for c in self.node_costs]
        mems = [np.asarray(m) for m in self.node_memory]
        for i, (cost, mem) in enumerate(zip(costs, mems)):
            if cost.ndim != 1 or cost.size == 0:
                raise ValueError(
                    f"{self.name(i)}: node_costs must be a non-empty 1-D array, got shape {cost.shape}"
                )
            if mem.shape != cost.shape:
                raise ValueError(
                    f"{self.name(i)}: node_memory shape {mem.shape} != node_costs shape {cost.shape}"
                )
        if n and not np.isfinite(np.concatenate(costs + mems)).all():
            for i, (cost, mem) in enumerate(zip(costs, mems)):
                if not np.all(np.isfinite(cost)):
                    raise ValueError(f"{self.name(i)}: node_costs must be finite, got {cost}")
                if not np.all(np.isfinite(mem)):
                    raise ValueError(f"{self.name(i)}: node_memory must be finite, got {mem}")
        mats = []
        for idx, edge in enumerate(self.edges):
            if len(edge) != 3:
                raise ValueError(f"edge {idx}: expected (u, v, R), got {len(edge)} items")
            u, v, mat = edge
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"edge {idx}: endpoints ({u}, {v}) out of range for {n} nodes")
            if u == v:
                # A self-loop would only ever read R's diagonal; the caller should fold it
                # into the node cost rather than have every backend special-case it.
                raise ValueError(f"edge {idx}: self-loop on {self.name(u)}")
            mat = np.asarray(mat)
            want = (len(costs[u]), len(costs[v]))
            if mat.shape != want:
                raise ValueError(
                    f"edge {idx} ({self.name(u)} -> {self.name(v)}): R has shape {mat.shape}, "
                    f"expected {want}"
                )
            mats.append(mat.ravel())
        if mats:
            flat = np.concatenate(mats)
            if np.isnan(flat).any() or (flat == -np.inf).any():
                for idx, (u, v, mat) in enumerate(self.edges):
                    mat = np.asarray(mat)
                    if np.any(np.isnan(mat)) or np.any(mat == -np.inf):
                        raise ValueError(
                            f"edge {idx} ({self.name(u)} -> {self.name(v)}): R entries must be "
                            "finite or +inf (forbidden)"
                        )
        if self.memory_budget is not None and math.isnan(self.memory_budget):
            raise ValueError("memory_budget is NaN")


class SolveStatus(StrEnum):
    """How good the returned plan is known to be."""

    OPTIMAL = "optimal"
    """Proven optimal (up to floating-point tolerance of the backend)."""
    FEASIBLE = "feasible"
    """Feasible but not proven optimal, e.g. the time limit stopped the search."""


@dataclass
class Solution:
    """A plan: ``choice[i]`` is the strategy index picked for node ``i``.

    ``objective`` is recomputed exactly from the problem (not the solver's scaled value);
    ``gap`` is the relative optimality gap (0 when optimal, ``None`` when no bound is
    known); ``message`` explains the status in one sentence for the user.
    """

    choice: list[int]
    objective: float
    status: SolveStatus
    gap: float | None
    solver: str
    wall_time: float
    message: str


class InfeasibleError(ValueError):
    """No plan satisfies the memory budget (or the forbidden resharding pairs).

    ``min_memory`` is the smallest memory any plan that respects the forbidden pairs can
    reach (``inf`` when the forbidden pairs alone leave no plan).
    """

    def __init__(self, message: str, min_memory: float) -> None:
        super().__init__(message)
        self.min_memory = min_memory


def format_bytes(num: float) -> str:
    """Render a byte count with a binary unit, e.g. ``1.7 GiB``."""
    if not math.isfinite(num):
        return str(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} B" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def evaluate(problem: StrategyProblem, choice: Sequence[int]) -> tuple[float, float]:
    """Return ``(objective, memory)`` of ``choice``; objective is ``inf`` on a forbidden pair."""
    if len(choice) != problem.num_nodes:
        raise ValueError(f"choice has {len(choice)} entries for {problem.num_nodes} nodes")
    objective = math.fsum(float(c[x]) for c, x in zip(problem.node_costs, choice))
    memory = math.fsum(float(m[x]) for m, x in zip(problem.node_memory, choice))
    edge_cost = math.fsum(float(mat[choice[u], choice[v]]) for u, v, mat in problem.edges)
    return objective + edge_cost, memory
