"""Reading a plan: the summary in words (``summary``), ``explain`` (``explain``), the
per-node table (``table``), the predicted timeline and trace (``timeline``) and every
collective of a step (``collectives``, ``messages``).

It reads plans and may import :mod:`autopar.sharding`, :mod:`autopar.capture`,
:mod:`autopar.runtime`, :mod:`autopar.plan` and :mod:`autopar.cost_models`; it never
imports :mod:`autopar.search` or :mod:`autopar.module`.
"""
