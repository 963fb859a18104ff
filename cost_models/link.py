"""The link one mesh axis communicates over: :class:`LinkSpec` (alpha-beta, per collective
kind where a backend's kinds differ), with the checks :mod:`.mesh` shares."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KIND_NAMES", "LinkSpec"]

KIND_NAMES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                               "broadcast", "send_recv")
"""The collective kinds a link can price differently (``CollectiveKind`` values)."""


def _check_positive_finite(owner: str, name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be finite and > 0, got {value!r}")


def _check_latency(owner: str, name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a finite number >= 0 (a latency may be 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be finite and >= 0, got {value!r}")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    """Raise ValueError unless ``value`` is an int (not bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class LinkSpec:
    """The link one mesh axis communicates over (the alpha-beta model).

    ``alpha`` is the latency of one message step in seconds and ``beta`` the bandwidth in
    bytes/s of one rank's link. A hierarchical axis that spans nodes sets ``inter``: then
    ``group`` ranks of the axis share a node and talk over this link (``alpha``, ``beta``), and the
    remaining ``p / group`` factor of the axis crosses the ``inter`` link.

    ``kinds`` holds ``(kind, alpha, beta)`` for collective kinds that behave unlike the
    link's all-reduce, each used in that kind's own formula
    (:mod:`autopar.cost_models.collective_costs`): :func:`~autopar.cost_models.calibrate`
    fits one per kind from measured curves, and the cpu-gloo preset uses one for gloo's
    reduce-scatter, which runs as a whole all-reduce.  A kind not listed uses ``alpha``
    and ``beta``.
    """

    alpha: float
    beta: float
    inter: LinkSpec | None = None
    group: int = 1
    kinds: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        """Validate: alpha >= 0 finite, beta > 0 finite, group >= 1 and only with ``inter``."""
        _check_latency("LinkSpec", "alpha", self.alpha)
        _check_positive_finite("LinkSpec", "beta", self.beta)
        _check_int("LinkSpec", "group", self.group, 1)
        if self.inter is not None and not isinstance(self.inter, LinkSpec):
            raise ValueError(f"LinkSpec.inter must be a LinkSpec or None, got {self.inter!r}")
        # Without an inter link there is no second level, so a group size would be silently
        # meaningless; reject it rather than let a typo change nothing.
        if self.inter is None and self.group != 1:
            raise ValueError(f"LinkSpec.group={self.group} only applies when inter is set")
        # Sorted tuples: equal links compare and hash equal whatever order they were given in.
        try:
            kinds = tuple(sorted((str(k), a, b) for k, a, b in self.kinds))
        except (TypeError, ValueError):
            raise ValueError(f"LinkSpec.kinds must be (kind, alpha, beta) triples, got {self.kinds!r}") from None
        object.__setattr__(self, "kinds", kinds)
        names = [k for k, _, _ in kinds]
        if len(set(names)) != len(names) or not set(names) <= set(KIND_NAMES):
            raise ValueError(f"LinkSpec.kinds must name distinct kinds among {KIND_NAMES}, got {names}")
        for k, a, b in kinds:
            _check_latency("LinkSpec", f"kinds[{k!r}] alpha", a)
            _check_positive_finite("LinkSpec", f"kinds[{k!r}] beta", b)

    def for_kind(self, kind: str) -> tuple[float, float]:
        """``(alpha, beta)`` of collective ``kind`` (a :data:`KIND_NAMES` entry) on this link."""
        for k, a, b in self.kinds:
            if k == kind:
                return a, b
        return self.alpha, self.beta

    @property
    def hierarchical(self) -> bool:
        """True when the axis spans nodes (``inter`` is set)."""
        return self.inter is not None

    def levels(self, p: int) -> list[tuple[LinkSpec, int]]:
        """Split an axis of ``p`` ranks on this link into flat ``(link, ranks)`` levels.

        The innermost level comes first: ``[(intra, group), (inter, p // group)]`` for a
        hierarchical link, ``[(self, p)]`` otherwise. Returned links never have ``inter`` set.
        """
        _check_int("LinkSpec.levels", "p", p, 1)
        if self.inter is None:
            return [(self, p)]
        if p % self.group:
            raise ValueError(f"axis of {p} ranks is not a multiple of LinkSpec.group={self.group}")
        flat = LinkSpec(alpha=self.alpha, beta=self.beta, kinds=self.kinds)
        return [(flat, self.group), *self.inter.levels(p // self.group)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict; ``inter`` nests as a dict or None."""
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "inter": None if self.inter is None else self.inter.to_dict(),
            "group": self.group,
            "kinds": {k: [a, b] for k, a, b in self.kinds},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkSpec:
        """Inverse of :meth:`to_dict`; unknown keys are a ValueError."""
        unknown = set(d) - {"alpha", "beta", "inter", "group", "kinds"}
        if unknown:
            raise ValueError(f"unknown LinkSpec keys: {sorted(unknown)}")
        inter = d.get("inter")
        return cls(
            alpha=d["alpha"],
            beta=d["beta"],
            inter=None if inter is None else cls.from_dict(inter),
            group=d.get("group", 1),
            kinds=_kinds_from(d.get("kinds")),
        )


def _kinds_from(value: Any) -> tuple:
    """``LinkSpec.kinds`` from its JSON form ``{kind: [alpha, beta]}`` (None: none)."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"LinkSpec kinds must be a mapping of kind to [alpha, beta], got {value!r}")
    try:
        return tuple((k, *ab) for k, ab in value.items())
    except TypeError:
        raise ValueError(f"LinkSpec kinds must map a kind to [alpha, beta], got {value!r}") from None
