"""Numerical equivalence of every plan-level parallelism kind on real gloo ranks
(issue 3), through the public ``auto_parallel(..., zero_stage=..., pipeline_stages=...,
micro_batches=..., schedule=..., recompute=...)``, against the single-process model on
the same global batch: loss, every gradient (gathered from the rank/stage that holds
it) and the parameters after two SGD-with-momentum and two AdamW steps.

Tolerances are test_equivalence.py's (fp32; the parallel module sums the same
products in another order): loss rtol 1e-5; gradients and SGD parameters 2e-5 + 1e-4
x the largest gradient; AdamW parameters 1e-4 (10% of one lr=1e-3 step).  Micro-
batching adds one more reordering (the batch mean becomes a mean of micro-batch
means), of the same few-ulp size.

Each case also measures every rank's peak tensor memory over one training step
(autopar.runtime.memstats: parameters, gradients, optimizer state and activations)
and compares it with the plan's predicted memory for that rank's stage; the ratios
are reported in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import Case, run_cases
from tests.dist.test_equivalence import MEGATRON, check

GPT2 = {"layers": 2}
DP = {"*": "R", "input:0": "S(0)"}
DP2X2 = {"*": "RR", "input:0": "S(0)S(0)"}
TP = MEGATRON["gpt"]
PP2_M4 = {"pipeline_stages": 2, "micro_batches": 4}
SINGLE = {"pipeline_stages": 1, "micro_batches": 1}
INTERLEAVED2 = {**PP2_M4, "schedule": "interleaved-1f1b", "virtual_stages": 2}

TWO = [
    Case("zero1-dp2", "gpt", (2,), DP, GPT2, options={"zero_stage": 1, **SINGLE}, measure_memory=True),
    Case("zero2-dp2", "gpt", (2,), DP, GPT2, options={"zero_stage": 2, **SINGLE}, measure_memory=True),
    Case("zero3-dp2", "gpt", (2,), DP, GPT2, options={"zero_stage": 3, **SINGLE}, measure_memory=True),
    # every layer re-gathered in backward (FSDP2's default); and a budget under keeping
    # them all (2.90 MB planned; 2.62 MB re-gathering all): the planner keeps the last
    # layers only, so backward re-gathers the first ones after kept ones (the prefetch
    # that skips kept layers)
    Case("zero3-dp2-reshard", "gpt", (2,), DP, GPT2,
         options={"zero_stage": 3, "reshard_after_forward": True, **SINGLE}, measure_memory=True),
    Case("zero3-dp2-some-kept", "gpt", (2,), DP, GPT2,
         options={"zero_stage": 3, "memory_budget": 2.7e6, **SINGLE}, measure_memory=True),
    # ZeRO-3 under accumulation: memory allowing, the whole gradients summed over the
    # micro-batches and reduce-scattered once (2.67 MB planned); under 2.2 MB, in every
    # micro-batch's backward (2.12 MB)
    Case("zero3-accumulate2-dp2", "gpt", (2,), DP, GPT2,
         options={"zero_stage": 3, "pipeline_stages": 1, "micro_batches": 2}, measure_memory=True),
    Case("zero3-accumulate2-dp2-lean", "gpt", (2,), DP, GPT2,
         options={"zero_stage": 3, "pipeline_stages": 1, "micro_batches": 2, "memory_budget": 2.2e6},
         measure_memory=True),
    Case("pp2-gpipe", "gpt", (2,), {}, GPT2, options={**PP2_M4, "schedule": "gpipe"}, measure_memory=True),
    Case("pp2-1f1b", "gpt", (2,), {}, GPT2, options={**PP2_M4, "schedule": "1f1b"}, measure_memory=True),
    # ZeRO-2 under accumulation: the runtime reduces after the last micro-batch, so it
    # keeps whole gradients until then (the model counted sharded ones before)
    Case("zero2-accumulate4-dp2", "gpt", (2,), DP, GPT2,
         options={"zero_stage": 2, "pipeline_stages": 1, "micro_batches": 4}, measure_memory=True),
]
# bf16-mixed (bf16 compute, fp32 parameters, gradients and optimizer state), for the
# memory model only: its equivalence, against the model under autocast, is
# tests/dist/test_mixed_precision.py's
BF16 = {"precision": "bf16-mixed"}
TWO_BF16 = [
    Case("bf16-dp2", "gpt", (2,), DP, GPT2, options={**BF16, **SINGLE}, measure_memory=True),
    Case("bf16-zero3-dp2", "gpt", (2,), DP, GPT2, options={**BF16, "zero_stage": 3, **SINGLE},
         measure_memory=True),
]
# more two-rank cases (slow CI step: a 2-rank spawn of their own, ~15 s on 2 cores): the
# other pipeline schedules, recomputation (tests/dist/test_recompute_dist.py's by
# default), accumulation without ZeRO and the wide and MLP models
TWO_MORE = [
    # interleaved 1F1B: each rank runs two model chunks (pre + blocks.1 on rank 0)
    Case("pp2-interleaved2", "gpt", (2,), {}, GPT2, options=INTERLEAVED2, measure_memory=True),
    # zero-bubble: backward split into input (B) and weight (W) gradients, W deferred
    Case("pp2-zero-bubble", "gpt", (2,), {}, GPT2, options={**PP2_M4, "schedule": "zero-bubble"},
         measure_memory=True),
    Case("recompute-tp2", "gpt", (2,), TP, GPT2, options={"recompute": ["blocks.0"], **SINGLE},
         measure_memory=True),
    Case("accumulate4-dp2", "gpt", (2,), DP, GPT2,
         options={"pipeline_stages": 1, "micro_batches": 4}, measure_memory=True),
    Case("zero2-mlp-dp2", "mlp", (2,), DP, options={"zero_stage": 2, **SINGLE}),
    # parameters outweigh activations: the end of backward is the peak, where the
    # runtime once held every gradient twice (a bucket copy of each until the end:
    # measured / predicted 1.2 then)
    Case("dp2-wide-gpt", "gpt", (2,), DP, {"layers": 2, "dim": 192, "seq": 8, "batch": 4},
         options={"zero_stage": 0, **SINGLE}, measure_memory=True),
    Case("bf16-pp2-1f1b", "gpt", (2,), {}, GPT2, options={**BF16, **PP2_M4, "schedule": "1f1b"},
         measure_memory=True),
]
FOUR = [
    Case("zero1-dp4", "gpt", (4,), DP, GPT2, options={"zero_stage": 1, **SINGLE}),
    Case("zero3-dp4", "gpt", (4,), DP, GPT2, options={"zero_stage": 3, **SINGLE}),
    # ZeRO-3 over the data-parallel axis 0 x Megatron tensor parallelism on axis 1
    Case("zero3-x-tp2", "gpt", (2, 2), {k: "R" + v for k, v in TP.items()} | {"input:0": "S(0)R"},
         GPT2, options={"zero_stage": 3, **SINGLE}, measure_memory=True),
    # HSDP: ZeRO-3 over axis 1, replicated (all-reduced) over axis 0
    Case("hsdp-zero3-2x2", "gpt", (2, 2), DP2X2, GPT2,
         options={"zero_stage": 3, "zero_axes": (1,), **SINGLE}, measure_memory=True),
    # two stages, each a data-parallel pair
    Case("pp2-x-dp2", "gpt", (4,), DP, GPT2, options={**PP2_M4, "schedule": "1f1b"}, measure_memory=True),
    # zero-bubble with tensor-parallel pairs (collectives inside B and W)
    Case("tp2-x-pp2-zero-bubble", "gpt", (4,), TP, GPT2,
         options={**PP2_M4, "schedule": "zero-bubble"}, measure_memory=True),
]
# more combinations on four ranks (slow CI step: a 4-rank spawn of their own, ~20 s on 2
# cores): other ZeRO axes, bucket choices and pipeline schedules of the kinds above
FOUR_MORE = [
    # one gradient bucket for all (what a calibrated link picks on this host): the runtime
    # allocates it whole at the first gradient, which the memory model counted layer by
    # layer (measured / predicted 1.18)
    Case("dp4-one-bucket", "gpt", (4,), DP, GPT2,
         options={"zero_stage": 0, "bucket_bytes": 2**40, **SINGLE}, measure_memory=True),
    # ZeRO over both axes of a 2-D data-parallel mesh (one group of 4 spanning them)
    Case("zero1-over-2x2", "gpt", (2, 2), DP2X2, GPT2,
         options={"zero_stage": 1, "zero_axes": (0, 1), **SINGLE}, measure_memory=True),
    Case("zero3-over-2x2", "gpt", (2, 2), DP2X2, GPT2,
         options={"zero_stage": 3, "zero_axes": (0, 1), **SINGLE}, measure_memory=True),
    # ZeRO-1 over axis 0, replicated over axis 1 (HSDP): a bucket's part is all-reduced
    # over axis 1 in one collective; ZeRO-2 x TP2: a bucket mixes tensor-parallel
    # weights (nothing more to reduce) and replicated norms and biases (over axis 1)
    Case("hsdp-zero1-2x2", "gpt", (2, 2), DP2X2, GPT2,
         options={"zero_stage": 1, "zero_axes": (0,), **SINGLE}),
    Case("zero2-x-tp2", "gpt", (2, 2), {k: "R" + v for k, v in TP.items()} | {"input:0": "S(0)R"},
         GPT2, options={"zero_stage": 2, "zero_axes": (0,), **SINGLE}),
    # two stages of two chunks each, every stage a data-parallel pair
    Case("pp2-interleaved2-x-dp2", "gpt", (4,), DP, GPT2, options=INTERLEAVED2,
         measure_memory=True),
    # four stages of two chunks each (8 virtual stages: pre, 6 blocks, post)
    Case("pp4-interleaved2", "gpt", (4,), {}, {"layers": 6},
         options={"pipeline_stages": 4, "micro_batches": 8, "schedule": "interleaved-1f1b",
                  "virtual_stages": 2}),
    # zero-bubble with data-parallel pairs (gradients reduced after the last W) and
    # ZeRO-2 over them
    Case("pp2-zero-bubble-x-dp2-zero2", "gpt", (4,), DP, GPT2,
         options={**PP2_M4, "schedule": "zero-bubble", "zero_stage": 2}, measure_memory=True),
    # two stages, each a tensor-parallel pair
    Case("tp2-x-pp2", "gpt", (4,), TP, GPT2, options={**PP2_M4, "schedule": "1f1b"}, measure_memory=True),
]


@pytest.fixture(scope="module")
def two_rank_results():
    return run_cases(2, TWO + TWO_BF16)


@pytest.fixture(scope="module")
def two_rank_more_results():
    return run_cases(2, TWO_MORE)


@pytest.fixture(scope="module")
def four_rank_results():
    return run_cases(4, FOUR)


@pytest.fixture(scope="module")
def four_rank_more_results():
    return run_cases(4, FOUR_MORE)


def check_decisions(res: dict, case: Case) -> None:
    """The forced decisions are the plan's."""
    d = res["decisions"]
    o = case.options
    assert d["zero"] == o.get("zero_stage", d["zero"])
    if "zero_axes" in o:
        assert tuple(d["zero_axes"]) == tuple(o["zero_axes"])
    assert d["stages"] == o.get("pipeline_stages", d["stages"])
    assert d["pipeline_axis"] == o.get("pipeline_axis", d["pipeline_axis"])
    assert d["micro_batches"] == o.get("micro_batches", d["micro_batches"])
    assert d["schedule"] == o.get("schedule", d["schedule"])
    assert d["virtual_stages"] == o.get("virtual_stages", 1)
    assert d["recompute"] == sorted(o.get("recompute", d["recompute"]))
    if o.get("reshard_after_forward") is not None:
        # True: no layer kept gathered; False: every layer (all are ZeRO-3 here)
        assert bool(d["zero_kept"]) is not o["reshard_after_forward"]
    if d["zero"] != 3:
        assert d["zero_kept"] == []


def _res(results: dict, case: Case) -> dict:
    return results.get(case.id, {"error": "not run (an earlier case failed)"})


@pytest.mark.parametrize("case", TWO, ids=[c.id for c in TWO])
def test_two_ranks(two_rank_results, case):
    res = _res(two_rank_results, case)
    check(res)
    check_decisions(res, case)


@pytest.mark.parametrize("case", FOUR, ids=[c.id for c in FOUR])
def test_four_ranks(four_rank_results, case):
    res = _res(four_rank_results, case)
    check(res)
    check_decisions(res, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_MORE, ids=[c.id for c in TWO_MORE])
def test_two_ranks_more(two_rank_more_results, case):
    res = _res(two_rank_more_results, case)
    if case.options.get("precision") == "bf16-mixed":
        _check_bf16(res)
    else:
        check(res)
    check_decisions(res, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FOUR_MORE, ids=[c.id for c in FOUR_MORE])
def test_four_ranks_more(four_rank_more_results, case):
    res = _res(four_rank_more_results, case)
    check(res)
    check_decisions(res, case)


@pytest.mark.parametrize("case", TWO_BF16, ids=[c.id for c in TWO_BF16])
def test_bf16_cases_train(two_rank_results, case):
    """The bf16-mixed cases train to the fp32 model's loss (:func:`_check_bf16`)."""
    res = _res(two_rank_results, case)
    _check_bf16(res)
    check_decisions(res, case)


def _check_bf16(res: dict) -> None:
    """A bf16-mixed case ran its steps; its loss is the fp32 model's to bf16 rounding
    (8-bit mantissa: 2e-3 per op, a few on the way to an O(1) loss: 1e-2)."""
    assert "error" not in res, res.get("error")
    assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-2)


def test_zero3_keeps_layers_by_memory(two_rank_results):
    """ZeRO-3 keeps every layer gathered when memory allows, the last ones only under a
    budget between (the first re-gathered after kept ones), none when told."""
    kept = {cid: two_rank_results[cid]["decisions"]["zero_kept"]
            for cid in ("zero3-dp2", "zero3-dp2-some-kept", "zero3-dp2-reshard")}
    assert kept["zero3-dp2"] == ["pre", "blocks.0", "blocks.1", "post"]
    some = kept["zero3-dp2-some-kept"]
    assert some and "post" in some and "pre" not in some, some
    assert kept["zero3-dp2-reshard"] == []


def test_zero3_reduces_once_under_accumulation_when_memory_allows(two_rank_results):
    once = {cid: two_rank_results[cid]["decisions"]["zero_reduce_once"]
            for cid in ("zero3-accumulate2-dp2", "zero3-accumulate2-dp2-lean", "zero3-dp2")}
    assert once == {"zero3-accumulate2-dp2": True, "zero3-accumulate2-dp2-lean": False, "zero3-dp2": False}


def test_zero_shards_parameters(two_rank_results):
    """ZeRO-3 re-gathering every layer holds about half the parameter bytes of ZeRO-1
    per rank on 2 ranks (keeping them all gathered, it holds the same at the peak)."""
    z1 = two_rank_results["zero1-dp2"]["memory"][0]
    z3 = two_rank_results["zero3-dp2-reshard"]["memory"][0]
    assert z3["measured"] < z1["measured"]
    assert z3["predicted"] < z1["predicted"]


def _memory_off(*results: dict) -> list:
    """(case, rank, measured / predicted) of every measured peak outside [0.9, 1.1]."""
    rows = [(cid, m) for r in results for cid, res in r.items() for m in res.get("memory", [])]
    assert rows
    return [(cid, m["rank"], round(m["measured"] / m["predicted"], 3)) for cid, m in rows
            if not 0.9 <= m["measured"] / m["predicted"] <= 1.1]


def test_measured_memory_matches_the_model(two_rank_results, four_rank_results):
    """Every rank's measured peak is within 10% of the memory model's prediction
    (issue 10; 0.93-1.08 measured)."""
    bad = _memory_off(two_rank_results, four_rank_results)
    assert not bad, f"measured / predicted outside [0.9, 1.1]: {bad}"


@pytest.mark.slow
def test_measured_memory_matches_the_model_on_more(two_rank_more_results, four_rank_more_results):
    """The same 10% for the slow step's combinations."""
    bad = _memory_off(two_rank_more_results, four_rank_more_results)
    assert not bad, f"measured / predicted outside [0.9, 1.1]: {bad}"


def test_zero2_under_accumulation_keeps_whole_gradients(two_rank_results):
    """ZeRO-2 with 4 micro-batches holds whole gradients until the last backward, and
    the model says so: at its peak (a later micro-batch's backward) the gradients priced
    are whole, not this rank's half (the measured peak is held to the model's by the
    10% test above)."""
    mem = two_rank_results["zero2-accumulate4-dp2"]["decisions"]["memory"]
    # params are the whole parameters plus this rank's half shard: 1.5x the gradients
    assert mem["grads"] == pytest.approx(mem["params"] / 1.5)
