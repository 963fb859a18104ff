"""Search: from a captured graph and a mesh to the fastest :class:`~autopar.plans.Plan`
that fits memory.

Owns op placement (``op_placement`` over the ``solvers/``: ILP with presolve and
repeated-layer clustering, D-Rec), the prices it minimises (``node_prices``,
``edge_prices``), the plan-level joint search (``joint``, ``space``, ``captures``,
``forced``, ``budget``, ``why``) with its pipeline-stage DP (``stages/``) and gradient
buckets (``buckets``).  It may import :mod:`autopar.passes`, :mod:`autopar.sharding`,
:mod:`autopar.capture`, :mod:`autopar.runtime`, :mod:`autopar.plans` and
:mod:`autopar.cost_models`; it never imports :mod:`autopar.module` or
:mod:`autopar.report`.
"""
