"""Solvers of the op-placement problem (:class:`~autopar.search.solvers.problem.StrategyProblem`):
exact presolve and an Alpa-style MIP (``presolve``, ``ilp``, ``incumbents``,
``bounds``), repeated-layer clustering (``cluster*``) and D-Rec (``drec*``).  Generic:
they see a problem, not a graph."""
