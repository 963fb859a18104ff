"""A bounded memo for prices computed from objects that do not change once built.

The joint search prices the same collective, layer class or ZeRO layout millions of
times (millions of collective prices for a deep model on a large mesh, from a few
distinct layers), each time from a :class:`~autopar.cost_models.mesh.MeshSpec` (frozen)
or a list of layer statistics (never changed after the search builds it).  Hashing
those by value costs about what the price does, so :class:`IdentityMemo` keys on their
identities and holds them while their entry lives: an id cannot be reused by another
object while the memo keeps the first alive, so a hit is always the same object.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class IdentityMemo:
    """Values by (the identities of some objects, a hashable rest of the key).

    ``size`` bounds the entries: when full, the memo starts empty again (the search's
    working set is small; an LRU's bookkeeping would cost more than the rare miss)."""

    def __init__(self, size: int = 65536) -> None:
        self._size = size
        self._entries: dict[tuple, tuple[tuple[Any, ...], Any]] = {}

    def get(self, objs: tuple[Any, ...], rest: Hashable, make: Callable[[], T]) -> T:
        """The value for ``objs`` (by identity) and ``rest`` (by value); ``make()``
        computes it on a miss.  An exception from ``make`` propagates and stores nothing."""
        key = (tuple(map(id, objs)), rest)
        hit = self._entries.get(key)
        if hit is not None:
            return hit[1]
        value = make()
        if len(self._entries) >= self._size:
            self._entries.clear()
        self._entries[key] = (objs, value)  # objs kept alive: their ids stay theirs
        return value


__all__ = ["IdentityMemo"]
