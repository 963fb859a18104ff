"""Lowering: the captured graph rewritten into the per-rank graph a plan describes.

Each pass is a function ``(GraphModule, plan) -> GraphModule`` whose docstring states
what holds before and after: ``lower`` (shard, insert collectives, ``localize`` local op
forms), ``recompute``, ``split_stages``, ``device``, ``train_mode``.  Installed as
``autopar.passes``; it may import :mod:`autopar.sharding`, :mod:`autopar.capture`,
:mod:`autopar.runtime`, :mod:`autopar.plans` and :mod:`autopar.cost_models`.
"""
