"""The joint search's one time limit, split among its phases.

``time_limit`` is the search's whole budget, split explicitly among the phases so that
the estimates of a large search cannot spend it all and leave the chosen split's
full-depth solve, the one whose answer is returned, only the 1 s floor:

- **explore** (:data:`SHARES`: 75%): the plain candidate, then the other (stages,
  micro-batches) splits, most of them estimated from a shallow copy.  The plain candidate
  is always planned; the others stop when this phase's share is spent.  When nothing
  is estimated (``blocks=``, a model without identical repeated layers) and a plan
  fits, explore may spend the whole budget: confirm would have nothing to plan.
- **confirm** (the rest, with whatever explore left unused): the best estimated splits
  planned at full depth.  The first one is always planned.

A candidate starts while its phase has time left and is not cut short, so the last one
explored may run past the share; the confirm phase then gets what remains of the total.
An exact candidate (planned at full depth, whose plan may be returned as it is) gets
what is left of the whole budget for its solver, not only of its phase's share.  When
nothing fits with the fastest placements, the memory-lean re-plans run in the confirm
phase (the first of them always).

Capture and annotation are not charged (they depend on the model and the machine's load,
not on the search, and cannot be cut short).  Each phase's solver limit is what is left of
its share; the progress lines and ``plan.timings`` show it, and the CLI's timing line
says how the budget was spent (:func:`autopar.cli.tools.format_timings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class Phase(StrEnum):
    """A phase of the joint search (see the module docstring)."""

    EXPLORE = "explore"
    CONFIRM = "confirm"


SHARES: dict[Phase, float] = {Phase.EXPLORE: 0.75, Phase.CONFIRM: 0.25}
"""Each phase's share of ``time_limit`` (the confirm phase also gets what explore left)."""


@dataclass
class TimeBudget:
    """``total`` seconds of search split among :class:`Phase` s by :data:`SHARES`;
    ``uncharged()`` gives the seconds so far that do not count (capture, annotation)."""

    total: float
    uncharged: Callable[[], float] = lambda: 0.0
    start: float = field(default_factory=lambda: time.perf_counter())
    phase: Phase = Phase.EXPLORE
    used: dict[Phase, float] = field(default_factory=dict)
    # explore's share of ``total``: :data:`SHARES`'s, or all of it when there is nothing
    # to confirm (:meth:`explore_all`)
    explore_share: float = SHARES[Phase.EXPLORE]
    _entered: float = 0.0  # charged seconds when the current phase began
    # uncharged seconds before this budget began (a second pass after wrong estimates
    # starts a budget of its own: the first pass's captures are not its to deduct)
    _base: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._base = self.uncharged()

    def spent(self) -> float:
        """Charged seconds since the search began."""
        return time.perf_counter() - self.start - (self.uncharged() - self._base)

    def left_total(self) -> float:
        """Seconds left of the whole budget (never below 0): the solver limit of a
        candidate whose plan may be returned as it is (planned at full depth)."""
        return max(0.0, self.total - self.spent())

    def allowance(self, phase: Phase) -> float:
        """Seconds ``phase`` may spend: explore its share, confirm the rest of the total
        (its share plus what explore left, less what explore overran)."""
        if phase is Phase.EXPLORE:
            return self.total * self.explore_share
        return max(0.0, self.total - self.used.get(Phase.EXPLORE, 0.0))

    def deadline(self, phase: Phase | None = None) -> float:
        """Charged seconds by which ``phase`` (default: the current one) must end."""
        phase = phase or self.phase
        return self.total * self.explore_share if phase is Phase.EXPLORE else self.total

    def explore_all(self) -> None:
        """Let explore spend the whole budget: a search whose candidates are all planned
        at full depth has no estimate for the confirm phase to plan, so that phase's share
        would sit idle while exploring stops early."""
        self.explore_share = 1.0

    def left(self) -> float:
        """Seconds left to the current phase (never below 0)."""
        return max(0.0, self.deadline() - self.spent())

    def over(self) -> bool:
        """The current phase has spent its share (nothing left: a solver would get only
        the 1 s floor the joint search gives it)."""
        return self.spent() >= self.deadline()

    def enter(self, phase: Phase) -> None:
        """End the current phase (its seconds go to ``used``) and start ``phase``."""
        now = self.spent()
        self.used[self.phase] = self.used.get(self.phase, 0.0) + now - self._entered
        self.phase, self._entered = phase, now

    def status(self) -> str:
        """What is left, as the progress lines say it."""
        return f"{self.phase} budget: {self.left():.1f} s of its {self.allowance(self.phase):.1f} s left"

    def record(self, timings: dict[str, float]) -> None:
        """Each phase's allowance and charged seconds into a plan's ``timings``
        (``budget_explore``, ``search_explore``, ...)."""
        self.enter(self.phase)  # close the current phase's account
        for p in Phase:
            timings[f"budget_{p}"] = self.allowance(p)
            timings[f"search_{p}"] = self.used.get(p, 0.0)


__all__ = ["SHARES", "Phase", "TimeBudget"]
