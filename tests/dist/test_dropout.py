"""Dropout under autopar (docs/dropout.md): every rank draws the global mask from one
generator seeded alike and keeps its slice, so a parallel run with dropout equals the
single-process run with the same seed: loss on every rank and every gradient.

Fails on the main before this change: every rank drew the same local mask for its own
batch shard (correlated across samples, unlike one process), so losses and gradients
differed from the single-process model under data parallelism (a tensor-parallel
activation drew a mask per shard from one state: repeated blocks of mask).

Tolerances: test_equivalence.py's (loss rtol 1e-5; gradients 2e-5 + 1e-4 x the largest):
the masks are bit-identical, only sums are reordered.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_fn_cases

FN = "tests.dist.dropout_cases:run"
DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
TP = {"blocks.0.fc.weight": "S(0)", "blocks.0.fc.bias": "S(0)", "blocks.1.fc.weight": "S(1)"}
TWO = [
    {"id": "dp", "mesh": [2], "pins": DP},
    {"id": "tp", "mesh": [2], "pins": TP},
    {"id": "dp-recompute", "mesh": [2], "pins": DP,
     "options": {"recompute": ["blocks.0"], "pipeline_stages": 1, "micro_batches": 1}},
    {"id": "dp-accumulate", "mesh": [2], "pins": DP, "options": {"pipeline_stages": 1, "micro_batches": 2}},
    {"id": "gpt2-auto", "mesh": [2], "model": "gpt2"},
    # eval() reaches every chunk of an interleaved rank (it reached the first only)
    {"id": "pp2-interleaved-eval", "mesh": [2], "eval_only": True,
     "options": {"pipeline_stages": 2, "micro_batches": 2, "schedule": "interleaved-1f1b",
                 "virtual_stages": 2}},
]
FOUR = [{"id": "dp-x-tp", "mesh": [2, 2],
         "pins": {k: "R" + v for k, v in TP.items()} | {"input:0": "S(0)R", "input:1": "S(0)R"}}]


@pytest.fixture(scope="module")
def two():
    return run_fn_cases(2, FN, TWO)


@pytest.fixture(scope="module")
def four():
    return run_fn_cases(4, FN, FOUR)


def _check(r: dict) -> None:
    assert "error" not in r, r.get("error")
    for loss in r["losses"]:
        assert loss == pytest.approx(r["ref"], rel=1e-5)
    assert r["grad_err"] <= 2e-5 + 1e-4 * r["grad_scale"]
    assert r["eval_err"] < 1e-5


@pytest.mark.parametrize("case", [c["id"] for c in TWO])
def test_dropout_two_ranks(two, case):
    _check(two[case])


@pytest.mark.slow
def test_dropout_four_ranks(four):
    _check(four["dp-x-tp"])
