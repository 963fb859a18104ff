"""Context parallel on real gloo ranks: attention with the sequence split across ranks
(issue 14), against the single-process model.

The sequence of the tokens and labels is pinned split (``S(1)``), the weights replicated;
``context_parallel="exchange"`` makes the attention run on sequence chunks of q, k and v,
which lowers to
- Ulysses (all-to-all of heads and sequence) when the heads divide by the ranks,
- ring attention (key/value blocks passed around the ranks) when they do not:
  causal with the zigzag balance when each rank's chunk halves evenly, without it
  (the "odd chunk" case) when it does not.
``context_parallel="gather-kv"`` gathers the keys and values instead and each rank
attends its query rows; left to the planner, it picks among them.

Tolerances are those of tests/dist/test_equivalence.py, for the reasons given there:
the split attention sums the same terms in another order (Ulysses: none reordered
beyond the projections; ring: a blockwise log-sum-exp merge, ~1e-7 relative in fp32).
"""

from __future__ import annotations

import pytest

from tests.dist.harness import Case, run_cases
from tests.dist.test_equivalence import check

GPT = "gpt"


def _seq_pins(mesh: tuple[int, ...], cp_axis: int) -> dict:
    """Tokens and labels split on the sequence over ``cp_axis`` and on the batch over
    the other axes; every weight replicated."""
    data = "".join("S(1)" if a == cp_axis else "S(0)" for a in range(len(mesh)))
    return {"*": "R" * len(mesh), "input:0": data, "input:1": data}


def _case(id_: str, mesh: tuple[int, ...], heads: int, dim: int, seq: int,
          mode: str | None = "exchange", cp_axis: int = 0) -> Case:
    return Case(id=id_, model=GPT, mesh=mesh, pins=_seq_pins(mesh, cp_axis),
                build_kwargs={"layers": 2, "heads": heads, "dim": dim, "seq": seq},
                options={"context_parallel": mode} if mode else {})


TWO = [
    _case("ulysses-2", (2,), heads=4, dim=64, seq=32),
    _case("ring-balanced-2", (2,), heads=3, dim=48, seq=32),
    _case("ring-odd-chunk-2", (2,), heads=3, dim=48, seq=30),
    _case("gather-kv-2", (2,), heads=4, dim=64, seq=32, mode="gather-kv"),
    _case("planner-seq-2", (2,), heads=4, dim=64, seq=32, mode=None),
]
FOUR = [
    _case("ulysses-4", (4,), heads=4, dim=64, seq=32),
    _case("ring-balanced-4", (4,), heads=2, dim=32, seq=32),
    _case("dp-x-ulysses-2x2", (2, 2), heads=4, dim=64, seq=32, cp_axis=1),
    _case("dp-x-ring-2x2", (2, 2), heads=3, dim=48, seq=32, cp_axis=1),
]
EXPECT = {"ulysses": "ulysses_attention", "ring": "ring_attention",
          "dp-x-ulysses": "ulysses_attention", "dp-x-ring": "ring_attention",
          "gather-kv": "row_attention"}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_cases(2, TWO)


@pytest.fixture(scope="module")
def four_rank_results():
    return run_cases(4, FOUR)


def _check(r: dict, case_id: str) -> None:
    check(r)
    kind = case_id.rsplit("-", 1)[0]
    for prefix, fn in EXPECT.items():
        if kind.startswith(prefix):
            # the attention really ran split: the generated code calls the CP form
            assert fn in r["calls"], (case_id, r["calls"])


@pytest.mark.parametrize("case", [c.id for c in TWO])
def test_context_parallel_two_ranks(two_rank_results, case):
    _check(two_rank_results[case], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.id for c in FOUR])
def test_context_parallel_four_ranks(four_rank_results, case):
    _check(four_rank_results[case], case)
