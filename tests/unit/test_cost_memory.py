"""The memory model's formulas against hand-computed numbers: optimizer state, the peak
of live tensors, byte formatting, the breakdown."""

from __future__ import annotations

import pytest
from autopar.cost_models import (
    MemoryBreakdown,
    OptimizerKind,
    format_bytes,
    optimizer_state_bytes,
    peak_live_bytes,
)

approx = pytest.approx


# ----------------------------------------------------------------------------- memory


def test_optimizer_state_bytes() -> None:
    assert optimizer_state_bytes(1e9, OptimizerKind.ADAM) == 2e9  # 2.5e8 elems * 2 * 4 B
    assert optimizer_state_bytes(1e9, "AdamW") == 2e9
    assert optimizer_state_bytes(1e9, "sgd_momentum") == 1e9  # 2.5e8 * 1 * 4
    assert optimizer_state_bytes(1e9, OptimizerKind.SGD) == 0.0
    # bf16 params, fp32 states: 1e9 / 2 = 5e8 elements * 2 states * 4 B = 4e9
    assert optimizer_state_bytes(1e9, "adam", state_dtype_bytes=4, param_dtype_bytes=2) == 4e9
    with pytest.raises(ValueError, match="known: sgd, sgd_momentum, adam, adamw"):
        optimizer_state_bytes(1e9, "lion")
    with pytest.raises(ValueError):
        optimizer_state_bytes(-1, "adam")
    with pytest.raises(ValueError):
        optimizer_state_bytes(1e9, "adam", state_dtype_bytes=0)


def test_peak_live_bytes() -> None:
    # step 0: {0} = 10; step 1: {0, 1} = 30; step 2: {0, 2} = 40; step 3: {2, 3} = 70
    assert peak_live_bytes([10, 20, 30, 40], [2, 1, 3, 3]) == 70
    # the big value dies right away: step 0: 100, step 1: 1, step 2: 2
    assert peak_live_bytes([100, 1, 1], [0, 2, 2]) == 100
    # last_use past the end keeps a value to the end: step 1: 5 + 5 = 10
    assert peak_live_bytes([5, 5], [10, 1]) == 10
    assert peak_live_bytes([], []) == 0.0
    with pytest.raises(ValueError, match="last_use"):
        peak_live_bytes([1, 2], [1, 0])
    with pytest.raises(ValueError, match="entries"):
        peak_live_bytes([1, 2], [1])
    with pytest.raises(ValueError):
        peak_live_bytes([-1], [0])


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(1.2 * 2**30) == "1.2 GiB"
    assert format_bytes(2**20 - 1) == "1.0 MiB"  # 1023.999 KiB rounds up a unit
    assert format_bytes(-2048) == "-2.0 KiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"


def test_memory_breakdown() -> None:
    gib = 2**30
    mb = MemoryBreakdown(params=gib, grads=gib, optimizer=2 * gib, activations=gib / 2)
    assert mb.total == 4.5 * gib  # 1 + 1 + 2 + 0.5
    assert str(mb) == (
        "4.5 GiB (params 1.0 GiB, grads 1.0 GiB, optimizer 2.0 GiB, "
        "activations 512.0 MiB, buffers 0 B)"
    )
    assert mb.to_dict() == {
        "params": gib, "grads": gib, "optimizer": 2 * gib, "activations": gib / 2, "buffers": 0.0,
    }
    assert MemoryBreakdown(**mb.to_dict()) == mb
    assert (mb + mb).total == 9 * gib
    with pytest.raises(ValueError, match="activations"):
        MemoryBreakdown(params=0, grads=0, optimizer=0, activations=-1)
