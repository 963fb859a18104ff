"""The loss a ParallelModule returns equals the single-process loss on every rank, for
every loss kind (MSE, L1, cross-entropy with mean/sum, ignore_index and label smoothing,
NLL, user reductions like ``(o - y).pow(2).mean()``, ``reduction="none"`` then a mean) under
the planner's choice, forced data parallel (batch-sharded inputs) and Megatron tensor
parallel, on meshes (2,), (4,) and 2x2 (tests/dist/loss_cases.py).

Fails on the main before this fix: under data parallel MSE and L1 with a mean returned
each rank's partial loss (0.767 / 0.415 vs 1.182; examples/mlp.py at batch 4096:
0.5075 / 0.4992 vs 1.0067) because the mean's rescale hid the loss from the output's
all-reduce; ``mse_loss(reduction="none").mean()`` failed with ``KeyError: 'autopar'``.

Tolerances (test_equivalence.py's): loss rtol 1e-5; gradients 2e-5 + 1e-4 x the largest
gradient (fp32 sums in another order; sum reductions make gradients O(10)).
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_fn_cases
from tests.dist.loss_cases import KINDS

FN = "tests.dist.loss_cases:run"
TP = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)", "fc2.bias": "R"}


def _dp(n: int) -> dict:
    return {"*": "R" * n} | {f"input:{i}": "S(0)" * n for i in range(3)}


TWO = [{"id": "auto", "fn": "losses", "mesh": [2]},
       {"id": "dp", "fn": "losses", "mesh": [2], "pins": _dp(1)},
       {"id": "tp", "fn": "losses", "mesh": [2], "pins": TP},
       {"id": "mlp-4096", "fn": "mlp", "mesh": [2]}]
FOUR = [{"id": "dp4", "fn": "losses", "mesh": [4], "pins": _dp(1)},
        {"id": "dp-x-tp", "fn": "losses", "mesh": [2, 2],
         "pins": {k: "R" + v for k, v in TP.items()} | {f"input:{i}": "S(0)R" for i in range(3)}}]


@pytest.fixture(scope="module")
def two():
    return run_fn_cases(2, FN, TWO)


@pytest.fixture(scope="module")
def four():
    return run_fn_cases(4, FN, FOUR)


def _check(res: dict, case: str, kind: str) -> None:
    assert "error" not in res[case], res[case].get("error")
    r = res[case][kind]
    assert "error" not in r, r["error"]
    for loss in r["losses"]:
        assert loss == pytest.approx(r["ref"], rel=1e-5)
    assert r["grad_err"] <= 2e-5 + 1e-4 * r["grad_scale"]


@pytest.mark.parametrize("case", ["auto", "dp", "tp"])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_two_ranks(two, case, kind):
    _check(two, case, kind)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp4", "dp-x-tp"])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_four_ranks(four, case, kind):
    _check(four, case, kind)


def test_mlp_example_loss_on_every_rank(two):
    r = two["mlp-4096"]
    assert "error" not in r, r.get("error")
    for loss in r["losses"]:
        assert loss == pytest.approx(r["ref"], rel=1e-5)
