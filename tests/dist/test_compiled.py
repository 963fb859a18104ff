"""Compiled modules: ``auto_parallel(..., compile=True)`` on real gloo ranks, inductor's
CPU backend, against the single-process model (loss, every gradient, two SGD and two
AdamW steps: tests/dist/harness.py's run_case): data, tensor and ZeRO-3 parallel, context
parallel (Ulysses and ring attention) and expert parallel.

Only the per-rank graph is compiled (ParallelModule.compile); gradient buckets, ZeRO's
gathers and the DTensor gradients run as in eager.  Tolerances are
test_equivalence.py's (fp32): inductor fuses elementwise ops and may reorder a sum,
the same few-ulp reordering the parallel module already does.  Each case also checks
that the steps after the first made no new graph (dynamo did not recompile per step, as
it would if the parameters it guards on changed identity every call).

Slow CI step: compiling costs 10-30 s a case on 2 cores.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist.harness import Case, run_cases
from tests.dist.test_context_parallel import _case as cp_case
from tests.dist.test_equivalence import MEGATRON, check
from tests.dist.test_expert_parallel import BUILD as MOE
from tests.dist.test_expert_parallel import LAYERS, moe

GPT2 = {"layers": 2}
DP = {"*": "R", "input:0": "S(0)"}
ONE = {"pipeline_stages": 1, "micro_batches": 1, "compile": True}

CASES = [
    # not asked for: not compiled
    Case("default-dp2", "gpt", (2,), DP, GPT2, options={"pipeline_stages": 1, "micro_batches": 1}),
    Case("compiled-dp2", "gpt", (2,), DP, GPT2, options=ONE),
    Case("compiled-tp2", "gpt", (2,), MEGATRON["gpt"], GPT2, options=ONE),
    Case("compiled-zero3-dp2", "gpt", (2,), DP, GPT2, options={**ONE, "zero_stage": 3}),
    # both blocks recomputed: dynamo's checkpoint (autopar's replays dropout's generator
    # through a context_fn, which dynamo refuses: the graph fell back to eager before,
    # with the warning, while pm.compiled still said True)
    Case("compiled-recompute-dp2", "gpt", (2,), DP, GPT2,
         options={**ONE, "recompute": ["blocks.0", "blocks.1"]}),
    # ZeRO-1's gathers in chunks: each fetch runs eagerly between compiled pieces
    Case("compiled-zero1-chunks-dp2", "gpt", (2,), DP, GPT2,
         options={**ONE, "zero_stage": 1, "split_gathers": True}),
    # context parallel: Ulysses (all-to-all of heads and sequence) and ring attention
    # (key/value blocks passed around), the sequence split over the two ranks
    *(dataclasses.replace(c, id=f"compiled-{c.id}", options={**c.options, **ONE})
      for c in (cp_case("ulysses-2", (2,), heads=4, dim=64, seq=32),
                cp_case("ring-balanced-2", (2,), heads=3, dim=48, seq=32))),
    # expert parallel: the experts split, the dispatched tokens all-to-all there and back
    Case("compiled-moe-ep-2", "moe", (2,), moe.ep_pins(LAYERS, 1), MOE, options=ONE),
    # a pipeline: each stage's graph compiled, the 1F1B schedule and its transfers eager
    Case("compiled-pp2-1f1b", "gpt", (2,), {}, GPT2,
         options={"pipeline_stages": 2, "micro_batches": 2, "schedule": "1f1b", "compile": True}),
    # zero-bubble splits each backward on the eager autograd graph: asked, not compiled
    Case("eager-pp2-zero-bubble", "gpt", (2,), {}, GPT2,
         options={"pipeline_stages": 2, "micro_batches": 2, "schedule": "zero-bubble",
                  "compile": True}),
]
CALLS = {"compiled-ulysses-2": "ulysses_attention", "compiled-ring-balanced-2": "ring_attention"}


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_module_is_exact(results, case):
    res = results.get(case.id, {"error": "not run (an earlier case failed)"})
    check(res)
    assert res["compiled"] == ("compile" in case.options and not case.id.startswith("eager"))
    # and dynamo made graphs of it
    assert (res["dynamo_graphs"] > 0) == res["compiled"], res["dynamo_graphs"]
    if case.id in CALLS:  # the attention really ran split
        assert CALLS[case.id] in res["calls"], res["calls"]
    assert res["dynamo_recompiled"] == 0, res["dynamo_recompiled"]
