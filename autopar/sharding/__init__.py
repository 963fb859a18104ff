"""Sharding: which placements each op may take, and what moving between them costs in
collectives.

Owns the per-op rule registry (``rules/``, one file per op family), every node's
candidate strategies and pins (``strategies``), the redistributions between placements
(``redistribute``) and what an op's local form does by itself (``local_forms``).  It
may import :mod:`autopar.capture` (the IR), :mod:`autopar.runtime` (the local forms'
callables), :mod:`autopar.plans` and :mod:`autopar.cost_models`.
"""
