"""The module a plan runs as: :class:`~autopar.module.parallel.ParallelModule`, how each
plan decision is applied to it, and its export and load.

It applies a plan and never searches: it may import :mod:`autopar.passes`,
:mod:`autopar.sharding`, :mod:`autopar.capture`, :mod:`autopar.runtime`,
:mod:`autopar.plans` and :mod:`autopar.cost_models`, never :mod:`autopar.search`.
"""
