"""D-Rec's vocabulary: the option enums, :class:`DRecOptions` and the result records.

Kept apart from the search (:mod:`autopar.search.solvers.drec`) because callers that only build
options or read results (the planner front end, tests, benchmarks) need none of the
search machinery; :mod:`autopar.search.solvers.drec` takes and returns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from torch import fx

from autopar.sharding.rules import OpStrategy

__all__ = ["CostMode", "DRecOptions", "DRecResult", "Order", "Refine", "RoundInfo"]


class CostMode(StrEnum):
    """How a round prices a choice."""

    MODEL = "model"
    """autopar's CostModel (seconds), the ILP's prices: use this to plan."""
    MINDSPORE = "mindspore"
    """The symbolic formulas of MindSpore's D-Rec (element counts): reproduces its example."""


class Refine(StrEnum):
    """What follows the greedy pass of each round (production mode only)."""

    NONE = "none"
    """MindSpore's pure greedy."""
    SWEEPS = "sweeps"
    """Best-response sweeps: each group re-decided against all its neighbours."""
    EXACT = "exact"
    """The round's own problem (every node x its 1-D strategies on this axis, edges
    between them) solved exactly by autopar/search/solvers/ilp.py, kept when cheaper than the
    greedy pass.  It is small (1-D strategies, not their product over axes) and
    tree-like graphs are solved by elimination without a MIP."""


class Order(StrEnum):
    """The order in which groups are decided within a round."""

    TOPOLOGICAL = "topological"
    """Producers first."""
    REVERSE = "reverse"
    """Consumers first (the loss end decides first)."""
    WEIGHT = "weight"
    """MindSpore's: heaviest op first, weight = its cheapest cut's own cost this round."""


@dataclass(frozen=True)
class DRecOptions:
    """Knobs of the D-Rec search.

    ``refine`` says what follows each greedy round (:class:`Refine`; the mindspore cost
    mode always runs the pure greedy); ``refine_sweeps`` bounds the best-response sweeps;
    ``axis_order`` overrides the slowest-link-first order of the rounds.
    """

    cost_mode: CostMode = CostMode.MODEL
    order: Order = Order.REVERSE
    refine: Refine = Refine.EXACT
    refine_sweeps: int = 3
    axis_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Validate and normalise the enums (strings are accepted)."""
        object.__setattr__(self, "cost_mode", CostMode(self.cost_mode))
        object.__setattr__(self, "order", Order(self.order))
        object.__setattr__(self, "refine", Refine(self.refine))
        if self.refine_sweeps < 0:
            raise ValueError(f"refine_sweeps must be >= 0, got {self.refine_sweeps}")


@dataclass
class RoundInfo:
    """One round: the mesh axis it decided, how long it took, and how many groups the
    refinement sweeps changed."""

    axis: int
    size: int
    seconds: float
    refined: int = 0


@dataclass
class DRecResult:
    """The chosen strategy of every node, and how the search went.

    ``lam`` is the memory price the accepted plan was found with (0 when the plain plan
    fits the budget); ``memory`` its per-device bytes as the cost model counts them.
    """

    choice: dict[fx.Node, OpStrategy]
    rounds: list[RoundInfo]
    seconds: float
    memory: float
    lam: float = 0.0
    message: str = ""
