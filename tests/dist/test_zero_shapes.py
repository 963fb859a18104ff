"""Parameters under ZeRO keep their shapes, as FSDP2's do (issue 64, habit 7).

Before: ZeRO-1, 2 and 3 showed each parameter as a flat 1-D slice, so the common
``p.dim() < 2 -> no weight decay`` grouping put all of a GPT's tensors in the no-decay
group and trained silently wrong; and ``pm.state_dict()`` under ZeRO-3 gathered every
parameter, a collective, so rank 0 calling it alone (DDP's save habit) hung.  Now each
ZeRO parameter is a DTensor of its global shape, ``Shard(0)`` over the ZeRO axis, and
``state_dict()`` returns those shards without a collective.

Tolerances: losses rel 1e-5 and parameters after the AdamW steps 1e-4, as
test_equivalence.py (the ranks sum the same products in another order; each AdamW
update is at most lr = 1e-3, and 1e-4 is 10% of one).  The test also checks that it can
tell: the single process with every tensor in the no-decay group ends more than ten
times that tolerance away.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.harness import run_fn_cases

FN = "tests.dist.zero_shape_cases"
ADAM_TOL = 1e-4


@pytest.fixture(scope="module")
def decay():
    cases = [{"id": f"zero{s}", "stage": s} for s in (1, 2, 3)]
    cases += [{"id": f"odd-zero{s}", "stage": s, "model": "odd"} for s in (1, 2, 3)]
    return run_fn_cases(2, f"{FN}:decay_groups", cases)


@pytest.fixture(scope="module")
def decay_2x2():
    # ZeRO over both axes of a 2 x 2 mesh: 5 rows go 2, 1, 1, 1 (DTensor's nested chunks)
    opts = {"zero_axes": (0, 1), "pipeline_stages": 1, "micro_batches": 1}
    cases = [{"id": f"odd-zero{s}", "stage": s, "model": "odd", "mesh": [2, 2], "options": opts}
             for s in (2, 3)]
    return run_fn_cases(4, f"{FN}:decay_groups", cases)


def _rows(n: int, sizes: list[int]) -> list[int]:
    """Each rank's rows of ``n`` under DTensor's Shard(0) on each axis in turn
    (``torch.chunk``, empty chunks for the last ranks)."""
    counts = [n]
    for k in sizes:
        counts = [x for m in counts for x in _chunk(m, k)]
    return counts


def _chunk(n: int, k: int) -> list[int]:
    parts = [len(c) for c in torch.arange(n).chunk(k)] if n else []
    return parts + [0] * (k - len(parts))


@pytest.mark.parametrize("case", ["zero1", "zero2", "zero3", "odd-zero1", "odd-zero2", "odd-zero3"])
def test_weight_decay_grouping_on_dim_matches_one_process(decay, case):
    _check_decay(decay[case], case, [2])


@pytest.mark.parametrize("case", ["odd-zero2", "odd-zero3"])
def test_uneven_rows_over_two_zero_axes(decay_2x2, case):
    _check_decay(decay_2x2[case], case, [2, 2])


def _check_decay(r: dict, case: str, sizes: list[int]) -> None:
    assert "error" not in r, r.get("error")
    stage = case[-1]
    assert f"ZeRO-{stage}" in r["layout"], r["layout"]
    if not case.startswith("odd"):
        assert r["flat_err"] > 10 * ADAM_TOL  # the wrong grouping is visible at this tolerance
    # each rank holds DTensor's rows of every parameter (uneven dims 0 included)
    for name, shape in r["shapes"].items():
        want = _rows(shape[0], sizes)
        assert [rows[name] for rows in r["rows"]] == [[n, *shape[1:]] for n in want], name
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
    assert r["err"] <= ADAM_TOL, f"{r['worst']} off by {r['err']}"
    assert r["decayed"] == r["ref_decayed"] > 0
    # every parameter shows the original's shape, dims and size, as a DTensor
    for name, shape in r["shapes"].items():
        got_shape, dim, numel, kind = r["got"][name]
        assert (got_shape, dim, kind) == (shape, len(shape), "DTensor"), (name, r["got"][name], shape)
        assert numel == math.prod(shape), name


def test_state_dict_on_one_rank_under_zero3_is_local(tmp_path):
    # a collective in rank 0's lone call would wait for rank 1 until the group's timeout
    # (60 s here) and fail the case, not hang the test
    r = run_fn_cases(2, f"{FN}:save_alone", [{"id": "run", "ckpt": str(tmp_path / "ckpt")}],
                     group_timeout=60.0)["run"]
    assert "error" not in r, r.get("error")
    alone = r["alone"]
    assert sorted(alone) == sorted(r["shapes"])
    for key, (kind, shape, placements) in alone.items():
        assert kind == "DTensor" and shape == r["shapes"][key], (key, alone[key])
        assert placements == ["S(0)"], (key, placements)
    # the DCP round trip is exact (and the step after the save did move the weights)
    assert r["moved"] > 0
    assert r["exact"]
