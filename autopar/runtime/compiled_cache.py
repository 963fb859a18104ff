"""Keep torch's AOTAutograd cache from storing view metadata it cannot read back.

A compiled graph whose output is a view of another tensor (an intermediate or an
input) keeps, for that output, the chain of functionalization ``ViewMeta`` objects
that made it, and AOTAutograd's cache pickles the chain with the compiled graph.  In
torch 2.13 two of those classes, ``_unsafe_view_ViewMeta`` (``aten.linear`` and
``aten.matmul`` on 3-D inputs end in ``_unsafe_view``) and ``resize__ViewMeta``, pickle
their sizes through a reference to a freed temporary (pytorch/pytorch#185630, fixed
upstream by #184774 and #185861): the cache file holds garbage sizes, and the next
process that loads it replays the view with them (``shape '[94800193419548, ...]' is
invalid``) or, reading a garbage symbolic size, segfaults.  A rank that loads the
entry its peer has just written fails the same way in the first run.

autopar's generated graph meets this where dynamo breaks it at a runtime call (a
collective, the sharded cross-entropy): the piece before the break returns the
logits and a ``view`` of them, whose chain starts with the linear's ``_unsafe_view``.
A plain model compiles as one graph and returns the logits themselves, so it never
stores such a chain.

:func:`cache_safe_views` makes such a chain pickle as "no chain": AOTAutograd then
rebuilds that output from its base with ``as_strided`` (its own path for chains it
cannot replay, e.g. with symbolic sizes), every other entry is stored as before, and
the cache stays on.
"""

from __future__ import annotations

import copyreg

try:  # torch releases before the ViewMeta chains (pyproject allows torch>=2.4) store none
    from torch._functorch._aot_autograd.functional_utils import ViewMetaSequence
except ImportError:
    ViewMetaSequence = None

_UNSAFE = ("_unsafe_view_ViewMeta", "resize__ViewMeta")
"""ViewMeta classes whose pickled sizes are read from freed memory (torch 2.13)."""


def _none() -> None:
    """What an unsafe chain unpickles to: no chain."""
    return None


def _reduce(seq: ViewMetaSequence):
    # only the classes' names are read: reading an unsafe ViewMeta's sizes is the bug
    if any(type(vm).__name__ in _UNSAFE for vm in seq.sequence):
        return _none, ()
    return object.__reduce_ex__(seq, 2)


def cache_safe_views() -> None:
    """Make the AOTAutograd cache store an output's view chain only when it pickles
    right (see the module docstring).  Idempotent; called before autopar compiles."""
    if ViewMetaSequence is not None:
        copyreg.pickle(ViewMetaSequence, _reduce)


__all__ = ["cache_safe_views"]
