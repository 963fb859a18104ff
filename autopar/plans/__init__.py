"""The plan as data: what the search decided, and nothing that decides it.

Owns the typed :class:`Plan` and :class:`Decisions` (``data``), their JSON
(``json``), placements (``placement``), what a pipeline schedule runs (``schedules``)
and what a (stages, micro-batches) split means for ranks and batches (``splits``).
It may import only :mod:`autopar.cost_models` (the mesh a plan is made for) and
:mod:`autopar.errors`; everything else in autopar reads it.
"""

from autopar.plans.data import (
           SCHEMA_VERSION,
           Alternative,
           NodePlan,
           Plan,
           Redistribution,
           Request,
           SolverInfo,
           versions,
           zero_words,
)
from autopar.plans.decisions import Decisions, zero_axes
from autopar.plans.kinds import Schedule

__all__ = ["SCHEMA_VERSION", "Alternative", "Decisions", "NodePlan", "Plan", "Redistribution",
           "Request", "Schedule", "SolverInfo", "versions", "zero_axes", "zero_words"]
