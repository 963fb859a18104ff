"""The checks of the values a user forces a plan decision to (each registry
:class:`~autopar.plans.decisions.Option` names one): a bad value raises
:class:`~autopar.errors.ConfigError` naming the keyword."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.errors import ConfigError
from autopar.plans.kinds import Precision


def positive_int(name: str, v: Any) -> None:
    """An integer >= 1, else a ConfigError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def mesh_axis(name: str, v: Any) -> None:
    """A mesh axis: an integer >= 0, else a ConfigError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be a mesh axis (an integer >= 0), got {v!r}")


def flag(name: str, v: Any) -> None:
    """True or False, else a ConfigError naming ``name``."""
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be True, False or None, got {v!r}")


def one_of(values: tuple[str, ...], none: bool = False,
           fold_case: bool = False) -> Callable[[str, Any], None]:
    """A check that a value is one of ``values`` (lower-cased first with ``fold_case``)."""
    def check(name: str, v: Any) -> None:
        if (str(v).lower() if fold_case else v) not in values:
            raise ConfigError(f"{name} must be one of {', '.join(values)}"
                              f"{' or None' if none else ''}, got {v!r}")
    return check


def zero_stage(name: str, v: Any) -> None:
    """A ZeRO stage: 0, 1, 2 or 3, else a ConfigError naming ``name``."""
    if isinstance(v, bool) or v not in (0, 1, 2, 3):
        raise ConfigError(f"{name} must be 0, 1, 2 or 3, got {v!r}")


def zero_axes_value(name: str, v: Any) -> None:
    """A mesh axis, or a list of distinct ones, else a ConfigError naming ``name``."""
    items = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    ok = isinstance(items, (list, tuple)) and items and all(
        isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in items) \
        and len(set(items)) == len(items)
    if not ok:
        raise ConfigError(f"{name} must be a mesh axis or a list of distinct mesh axes "
                          f"(integers >= 0), got {v!r}")


def layer_names(name: str, v: Any) -> None:
    """A list of layer keys, else a ConfigError naming ``name``."""
    if not isinstance(v, (list, tuple, set, frozenset)) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{name}={v!r}: expected a list of layer names like ['blocks.0']")


def copies_check(name: str, v: Any) -> None:
    """Multi-copy's count: 1, 2 or ``'auto'``, else a ConfigError naming ``name``."""
    if v != "auto" and (isinstance(v, bool) or v not in (1, 2)):
        raise ConfigError(f"{name} must be 2 (two interleaved copies), 1, 'auto' or None, got {v!r}")


def precision(name: str, v: Any) -> None:
    """A precision :class:`Precision` parses, else a ConfigError naming ``name``."""
    try:
        Precision.parse(v)
    except ValueError as e:
        raise ConfigError(str(e)) from None


__all__ = ["copies_check", "flag", "layer_names", "mesh_axis", "one_of", "positive_int", "precision", "zero_axes_value", "zero_stage"]
