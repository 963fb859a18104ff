"""A chain node's elimination (:func:`autopar.search.solvers.presolve._min_over_middle`)
sums its (a, v, b) costs a block of rows at a time: the same choices, ties to the lowest
``v``, and the same sums bit for bit as the whole array reduced at once."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.search.solvers import presolve


@pytest.mark.parametrize("block", [1, 7, 1 << 15])
def test_blocked_min_is_the_whole_arrays(monkeypatch, block: int) -> None:
    monkeypatch.setattr(presolve, "_BLOCK", block)
    rng = np.random.default_rng(block)
    for ka, kv, kb in ((1, 1, 1), (5, 3, 4), (17, 9, 13), (40, 31, 6)):
        # few distinct values: many ties; some infinite (forbidden pairs)
        av = rng.integers(0, 4, (ka, kv)).astype(float) * 0.1
        vb = rng.integers(0, 4, (kv, kb)).astype(float) * 0.3
        av[rng.random(av.shape) < 0.2] = np.inf
        vb[rng.random(vb.shape) < 0.2] = np.inf
        whole = av[:, :, None] + vb[None, :, :]
        want = np.argmin(whole, axis=1)  # lowest index on ties
        best, merged = presolve._min_over_middle(av, vb)
        assert np.array_equal(best, want)
        assert np.array_equal(merged, np.take_along_axis(whole, want[:, None, :], axis=1)[:, 0, :])
