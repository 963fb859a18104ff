"""Per-device memory model: parameters, gradients, optimizer state and activations by liveness."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ._compat import StrEnum

__all__ = [
    "MemoryBreakdown",
    "OptimizerKind",
    "format_bytes",
    "optimizer_state_bytes",
    "peak_live_bytes",
]


class OptimizerKind(StrEnum):
    """Optimizers whose state size the memory model knows."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAM = "adam"
    ADAMW = "adamw"


# States kept per parameter element: momentum keeps one buffer, Adam/AdamW keep exp_avg and
# exp_avg_sq. (Adam's step counter is one scalar per tensor and is ignored.)
_STATES_PER_ELEMENT: dict[OptimizerKind, int] = {
    OptimizerKind.SGD: 0,
    OptimizerKind.SGD_MOMENTUM: 1,
    OptimizerKind.ADAM: 2,
    OptimizerKind.ADAMW: 2,
}


def _check_amount(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def optimizer_state_bytes(
    param_bytes: float,
    optimizer: OptimizerKind | str,
    state_dtype_bytes: int = 4,
    param_dtype_bytes: int = 4,
) -> float:
    """Bytes of optimizer state for parameters occupying ``param_bytes``.

    ``param_bytes / param_dtype_bytes`` elements, each with 0 (sgd), 1 (sgd_momentum) or 2
    (adam, adamw) states of ``state_dtype_bytes``. E.g. 1 GB of bf16 parameters under Adam with
    fp32 states: 0.5e9 elements * 2 states * 4 B = 4 GB.
    """
    _check_amount("param_bytes", param_bytes)
    try:
        kind = OptimizerKind(optimizer.lower() if isinstance(optimizer, str) else optimizer)
    except ValueError:
        known = ", ".join(k.value for k in OptimizerKind)
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {known}") from None
    for name, v in (("state_dtype_bytes", state_dtype_bytes), ("param_dtype_bytes", param_dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return param_bytes / param_dtype_bytes * _STATES_PER_ELEMENT[kind] * state_dtype_bytes


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``512 B``, ``1.5 KiB``, ``1.2 GiB`` (one decimal above bytes)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n):
        raise ValueError(f"format_bytes needs a finite number, got {n!r}")
    sign = "-" if n < 0 else ""
    v = abs(float(n))
    unit = 0
    # Round before comparing so 1023.96 KiB prints as "1.0 MiB", not "1024.0 KiB".
    while unit < len(_UNITS) - 1 and round(v, 1) >= 1024:
        v /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{v:.0f} B"
    return f"{sign}{v:.1f} {_UNITS[unit]}"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one device holds, by category; ``total`` is their sum."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float = 0.0

    def __post_init__(self) -> None:
        """Every category must be a finite number >= 0."""
        for name, v in self.to_dict().items():
            _check_amount(f"MemoryBreakdown.{name}", v)

    @property
    def total(self) -> float:
        """Sum of all categories, in bytes."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_dict(self) -> dict[str, float]:
        """Categories as a dict (``total`` not included, so it round-trips via ``**``)."""
        return asdict(self)

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        """Category-wise sum, e.g. over pipeline stages on one device."""
        if not isinstance(other, MemoryBreakdown):
            return NotImplemented
        return MemoryBreakdown(**{k: v + getattr(other, k) for k, v in self.to_dict().items()})

    def __str__(self) -> str:
        """``"1.2 GiB (params 400.0 MiB, grads ..., optimizer ..., activations ..., buffers ...)"``."""
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.to_dict().items())
        return f"{format_bytes(self.total)} ({parts})"


def peak_live_bytes(sizes: Sequence[float], last_use: Sequence[int]) -> float:
    """Peak bytes alive during a forward pass in program order.

    Value ``i`` (``sizes[i]`` bytes) is born at step ``i`` and freed after step ``last_use[i]``
    (``last_use[i] == i`` for a value nobody reads; a step past the end keeps it to the end).
    Returns the maximum over steps of the bytes alive at that step; 0.0 for no values.
    """
    if len(sizes) != len(last_use):
        raise ValueError(f"sizes has {len(sizes)} entries but last_use has {len(last_use)}")
    n = len(sizes)
    # Difference array: +size at birth, -size the step after the last use; O(n).
    delta = [0.0] * (n + 1)
    for i, (s, last) in enumerate(zip(sizes, last_use)):
        _check_amount(f"sizes[{i}]", s)
        if isinstance(last, bool) or not isinstance(last, numbers.Integral) or last < i:
            raise ValueError(f"last_use[{i}] must be an int >= {i} (its birth step), got {last!r}")
        delta[i] += s
        delta[min(last, n - 1) + 1] -= s
    peak = live = 0.0
    for step in range(n):
        live += delta[step]
        peak = max(peak, live)
    return peak
