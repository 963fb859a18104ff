"""Multi-copy overlap (decision ``copies``) trains exactly on real gloo ranks, against
the single process: loss, every gradient and the parameters after two SGD-with-momentum
and two AdamW steps (test_equivalence.py's tolerances: the two halves' losses are
averaged as two micro-batches' are, a few ulps from the whole batch's mean)."""

from __future__ import annotations

import pytest

from tests.dist.harness import Case, run_cases
from tests.dist.test_equivalence import MEGATRON, check

GPT2 = {"layers": 2}
TP = MEGATRON["gpt"]
DP_TP = {**{k: "R" + v for k, v in TP.items()}, "input:0": "S(0)R"}
CASES = [
    # Megatron tensor parallel: each block's all-reduces, forward and backward, split
    Case("copies-tp4", "gpt", (4,), TP, GPT2, options={"copies": 2}),
    # with data parallel on the other axis and ZeRO-3's gathers shared by the copies
    Case("copies-dp2-tp2-zero3", "gpt", (2, 2), DP_TP, GPT2, options={"copies": 2, "zero_stage": 3}),
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_cases(4, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_copies_train_exactly(results, case) -> None:
    res = results[case.id]
    check(res)
    assert res["decisions"]["micro_batches"] == 2
    # the generated code starts and waits for its collectives
    assert "start" in res["calls"] and "wait" in res["calls"]
