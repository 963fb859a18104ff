"""The plan space of a real cluster (issue 10): the default memory budget is the device
less its reserve, and the joint search tries every micro-batch count that divides the
batch.  Planning only (no process group)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from autopar import MeshSpec, plan
from autopar.plans.splits import micro_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

MESH = MeshSpec.preset("8xA100-nvlink", shape=(4,))
GIB = 2.0**30


def test_micro_counts_divide_the_batch() -> None:
    assert micro_counts(12, 1) == [1, 2, 3, 4, 6, 12]
    # a pipeline needs a micro-batch per stage: 3 stages on a batch of 6 get 3 or 6
    assert micro_counts(6, 3) == [3, 6]
    # published deep pipelines run 64-1,024 micro-batches (Alpa's GPT-39B: 1,024)
    assert micro_counts(1024, 16) == [16, 32, 64, 128, 256, 512, 1024]
    # fewer samples than stages: the most there can be
    assert micro_counts(5, 8) == [5]


def test_three_stages_get_a_micro_batch_each() -> None:
    # before, counts came from {1, 2, 4, 8, 16, 32}: a batch of 6 allowed only 1 and 2,
    # and a 3-stage pipeline ran 2 micro-batches (one stage always idle)
    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=6)
    d = plan(model, ex, MeshSpec.preset("8xA100-nvlink", shape=(3,)), pipeline_stages=3).decisions
    assert d.pipeline_stages == 3 and d.micro_batches in (3, 6)


def test_presets_reserve_memory_for_the_runtime() -> None:
    for name in ("8xA100-nvlink", "multinode-h100-ib"):
        m = MeshSpec.preset(name)
        # 1.5 GiB (CUDA context, NCCL buffers) plus 5% (allocator fragmentation)
        assert m.usable_memory == pytest.approx(80 * GIB * 0.95 - 1.5 * GIB)
    cpu = MeshSpec.preset("cpu-gloo")
    assert cpu.usable_memory == pytest.approx(cpu.mem_capacity - 0.5 * GIB)
    # the reserve survives the JSON a calibration writes and --mesh-json reads
    again = MeshSpec.from_json(MESH.to_json())
    assert (again.reserve_bytes, again.reserve_fraction) == (MESH.reserve_bytes, MESH.reserve_fraction)
    assert "reserve_bytes" in json.loads(MESH.to_json())


@pytest.mark.parametrize("kw,msg", [
    ({"reserve_bytes": -1.0}, "reserve_bytes"),
    ({"reserve_fraction": 1.0}, "reserve_fraction"),
    ({"reserve_bytes": 100 * GIB}, "leaves no memory"),
])
def test_bad_reserve_is_an_error(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(MESH, **kw)


@pytest.mark.slow  # ~7 s on 2 cores: a full search on a large model
def test_default_budget_leaves_the_reserve_free() -> None:
    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=32, batch=16)
    free = plan(model, ex, MESH)  # the unconstrained plan (ZeRO-2: tests/solver/test_joint.py)
    need = free.memory["total"]

    def kind(d):
        return d.zero_stage, d.recompute, d.pipeline_stages, d.micro_batches

    roomy = dataclasses.replace(MESH, mem_capacity=need * 1.2, reserve_bytes=0.0, reserve_fraction=0.0)
    assert kind(plan(model, ex, roomy).decisions) == kind(free.decisions) == (2, [], 1, 1)
    # the same device with half of it reserved: the plan must fit the other half
    tight = dataclasses.replace(roomy, reserve_fraction=0.5)
    p = plan(model, ex, tight)
    assert p.memory["total"] <= tight.usable_memory < need
    assert kind(p.decisions) != kind(free.decisions)
    # a budget given explicitly is what the plan may fill: no reserve taken from it
    assert kind(plan(model, ex, tight, memory_budget=need * 1.2).decisions) == kind(free.decisions)


def _wide_gpt():
    """A GPT wide enough that compute, not the kernel floor, prices its ops (on the meta
    device: planning only), with the data-parallel layout pinned so only memory differs."""
    import torch

    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(vocab=4096, seq=1024, dim=1024, heads=16, layers=2))
    tokens = torch.zeros(16, 1024, dtype=torch.long, device="meta")
    return model, (tokens, tokens.clone())


DP_PINS = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


def test_bf16_mixed_plans_differently_where_memory_decides() -> None:
    model, ex = _wide_gpt()
    # gradient buffers freed each step: kept ones would be what the budget takes away
    # first (decisions.grad_buffers_kept), not the precision's memory
    free = {prec: plan(model, ex, MESH, precision=prec, pins=DP_PINS, keep_grad_buffers=False)
            for prec in ("native", "bf16-mixed")}
    f32, b16 = (free[k].memory for k in ("native", "bf16-mixed"))
    # same fp32 parameters, gradients and AdamW state; bf16 activations are smaller: a
    # norm's fp32 output that only a cast to bf16 reads is not kept for backward (before,
    # it was counted beside its bf16 copy, and bf16-mixed came out only 13% smaller).
    # Autograd's saved tensors of this GPT at dim 256, sequence 256 measured 0.85 (bf16
    # autocast against fp32, autopar.runtime.memstats); the model gives 0.82 here
    assert b16["params"] == f32["params"] and b16["optimizer"] == f32["optimizer"]
    assert b16["activations"] < 0.86 * f32["activations"]
    budget = (f32["total"] + b16["total"]) / 2
    d32 = plan(model, ex, MESH, precision="native", pins=DP_PINS, memory_budget=budget,
               keep_grad_buffers=False).decisions
    d16 = plan(model, ex, MESH, precision="bf16-mixed", pins=DP_PINS, memory_budget=budget,
               keep_grad_buffers=False).decisions
    assert (d16.zero_stage, d16.recompute, d16.pipeline_stages, d16.micro_batches) == (0, [], 1, 1)
    assert d32.zero_stage or d32.recompute or d32.pipeline_stages > 1 or d32.micro_batches > 1
    assert max(d32.stage_memory) <= budget and max(d16.stage_memory) <= budget


def test_an_fp32_model_on_a_bf16_preset_is_warned_about() -> None:
    model, ex = gpt.build(layers=2, dim=64, heads=4, vocab=256, seq=16, batch=8)
    with pytest.warns(UserWarning, match="computes 100% of its FLOPs in float32.*19.5 TFLOP/s"):
        p = plan(model, ex, MESH)
    assert any("precision='bf16-mixed'" in w for w in p.warnings)
    # bf16-mixed, or a mesh with one rate for every dtype (cpu-gloo): nothing to say
    for kw in ({"precision": "bf16-mixed"}, {"mesh": MeshSpec.preset("cpu-gloo", shape=(4,))}):
        q = plan(model, ex, kw.pop("mesh", MESH), **kw)
        assert not any("float32" in w for w in q.warnings)


def test_pipelines_try_micro_batches_that_span_a_stage_first() -> None:
    from autopar.plans.decisions import PlanOptions
    from autopar.search.joint import JointSearch

    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=16)
    js = JointSearch(model, ex, MESH, PlanOptions())
    assert js.space.micro_order(1) == [1, 2, 4, 8, 16]  # no pipeline: the fewest first
    # 2 stages of 2 devices: the most micro-batches of at least 2 samples, then the rest
    # (every count down to one sample: a time limit must not be spent on those first)
    assert js.space.micro_order(2) == [8, 4, 2, 16]
    assert js.space.micro_order(4) == [16, 8, 4]  # 1 device per stage: one sample spans it


def test_pipelines_with_tensor_parallelism_in_a_node_try_megatrons_micro_batches_first() -> None:
    """A stage whose last axis lies inside a node (tensor parallelism there): first the
    most micro-batches with a sample per data-parallel rank of the stage (Megatron's
    layout), then its halvings, then the order above."""
    from autopar.plans.decisions import PlanOptions
    from autopar.search.joint import JointSearch

    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=64)
    js = JointSearch(model, ex, MeshSpec.preset("multinode-a100-ib", shape=(4, 8)), PlanOptions())
    # 2 stages of (2, 8): 2 data-parallel ranks, so 32 micro-batches of 2 samples first,
    # then its halvings (twice the samples each), then those with a sample per device of
    # the stage (16: 4 and 2 are among the halvings), then the rest
    assert js.space.micro_order(2) == [32, 16, 8, 4, 2, 64]
    js = JointSearch(model, ex, MeshSpec.preset("multinode-a100-ib", shape=(8, 4)), PlanOptions())
    # stages inside a node (axis 1): 2 stages of (8, 2), 8 data-parallel ranks
    assert js.space.micro_order(2, 1) == [8, 4, 2, 16, 32, 64]


@pytest.mark.slow  # ~12 s on 2 cores: a search per schedule
def test_each_pipeline_schedule_is_chosen_where_it_pays() -> None:
    """Four forced stages and four micro-batches of a 10-layer GPT, bf16-mixed:

    * NVLink, memory to spare: zero-bubble (a third of 1F1B's bubble, no extra sends;
      it keeps up to 2p - 1 micro-batches until their weight gradients run);
    * NVLink, a budget 20% over 1F1B's need: zero-bubble does not fit (and cannot
      recompute), interleaved 1F1B (two chunks per rank, half the bubble) does, and wins
      (each chunk within half the budget; 1F1B's first stage holds its 4 micro-batches
      before any gradient exists, the interleaved chunks meet earlier gradients, so at
      10% the first chunk recomputes a block);
    * a 1 GB/s link with that budget: interleaving's extra sends cost more than its
      bubble saves, and plain 1F1B wins."""
    model, ex = gpt.build(layers=8, dim=512, heads=8, vocab=1024, seq=256, batch=16)
    kw = {"pipeline_stages": 4, "micro_batches": 4, "precision": "bf16-mixed"}
    one = plan(model, ex, MESH, schedule="1f1b", **kw)
    free = plan(model, ex, MESH, **kw).decisions
    assert free.schedule == "zero-bubble"
    assert free.breakdown["bubble_seconds"] < 0.4 * one.decisions.breakdown["bubble_seconds"]
    budget = 1.2 * one.memory["total"]
    tight = plan(model, ex, MESH, memory_budget=budget, **kw)
    d = tight.decisions
    assert (d.schedule, d.virtual_stages) == ("interleaved-1f1b", 2)
    assert tight.memory["total"] <= budget and not d.recompute
    # 8 virtual stages covering the 10 layers in model order (rank r runs r and r + 4)
    assert len(d.stages) == 8 and d.stages[0][0] == "pre" and d.stages[-1][-1] == "post"
    assert [k for ks in d.stages for k in ks] == ["pre", *(f"blocks.{i}" for i in range(8)), "post"]
    assert d.step_seconds < one.decisions.step_seconds
    assert d.breakdown["bubble_seconds"] < 0.6 * one.decisions.breakdown["bubble_seconds"]
    with pytest.raises(Exception, match="needs|fits|budget"):
        plan(model, ex, MESH, memory_budget=budget, schedule="zero-bubble", offload="none", **kw)
    # left to the planner, zero-bubble fits with the optimizer's part in host memory
    assert plan(model, ex, MESH, memory_budget=budget, schedule="zero-bubble",
                **kw).decisions.offload != "none"
    link = dataclasses.replace(MESH.links[0], beta=1e9)
    slow = dataclasses.replace(MESH, links=(link,), intra=link)
    assert plan(model, ex, slow, memory_budget=budget, **kw).decisions.schedule == "1f1b"


@pytest.mark.parametrize("extra,msg", [({"recompute": ["blocks.0"]}, "recompute"),
                                       ({"zero_stage": 3}, "zero_stage=3")])
def test_zero_bubble_refuses_what_its_split_backward_cannot_run(extra, msg) -> None:
    from autopar.errors import PlanError

    model, ex = gpt.build(layers=2, dim=64, heads=4, vocab=256, seq=16, batch=8)
    with pytest.raises(PlanError, match=msg):
        plan(model, ex, MESH, pipeline_stages=2, micro_batches=4, schedule="zero-bubble", **extra)


def test_forced_interleaved_skips_micro_batch_counts_it_cannot_run() -> None:
    """Before, a forced interleaved schedule aborted the whole search at the first
    micro-batch count that is not a multiple of the stages (3 of a batch of 6 on 2
    stages, tried under explore=True) instead of planning the counts it can run."""
    from autopar.errors import PlanError

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(2,))
    kw = {"pipeline_stages": 2, "schedule": "interleaved-1f1b", "explore": True}
    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=6)
    d = plan(model, ex, mesh, **kw).decisions
    assert d.schedule == "interleaved-1f1b" and d.micro_batches % 2 == 0
    # a batch of 3 has no count it can run: said so, not "no plan within the time limit"
    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=3)
    with pytest.raises(PlanError, match="multiple of the pipeline stages"):
        plan(model, ex, mesh, **kw)


@pytest.mark.slow  # ~5 s on 2 cores: a search per forced count
def test_forced_virtual_stages_are_the_plans() -> None:
    """virtual_stages=2 without a schedule means interleaved 1F1B with two chunks, and
    virtual_stages=1 means no interleaving: before, both were priced beside the other
    schedules and the forced count was dropped when another won (zero-bubble here)."""
    model, ex = gpt.build(layers=8, dim=512, heads=8, vocab=1024, seq=256, batch=16)
    kw = {"pipeline_stages": 4, "micro_batches": 4, "precision": "bf16-mixed"}
    d = plan(model, ex, MESH, virtual_stages=2, **kw).decisions
    assert (d.schedule, d.virtual_stages) == ("interleaved-1f1b", 2)
    d = plan(model, ex, MESH, virtual_stages=1, memory_budget=2**40, **kw).decisions
    assert d.schedule != "interleaved-1f1b" and d.virtual_stages == 1


def test_later_rounds_visit_the_fastest_stage_counts_first(monkeypatch) -> None:
    """The first round takes each stage count's first micro-batch count in the stage
    counts' order; each later round starts with the stage counts whose plans so far were
    fastest (a time limit then cuts the unpromising ones)."""
    import math

    from autopar.plans.decisions import PlanOptions
    from autopar.search.joint import JointSearch
    from autopar.search.space import _Candidate
    from autopar.search.stages.priced import Config, Priced

    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=16)
    js = JointSearch(model, ex, MeshSpec.preset("cpu-gloo", shape=(4,)), PlanOptions())
    step = {1: 5.0, 2: 3.0, 4: math.inf}  # 2 stages fastest, 4 stages fit nowhere
    tried = []

    def fake_try(p, m, budget, estimate=False, axis=0, **kw):
        tried.append((p, m))
        cand = _Candidate(p, m, None, None, [], js.mesh, axis=axis)
        js.priced.append((cand, Priced(Config(stages=p, micro_batches=m), [], step[p], 0.0)))

    monkeypatch.setattr(js, "_try", fake_try)
    js._explore(first=(1, 1, 0), est=False)
    rounds = {p: js.space.micro_order(p) for p in (1, 2, 4)}
    assert tried[:2] == [(2, rounds[2][0]), (4, rounds[4][0])]  # round 1 (1 x 1: done)
    assert tried[2:5] == [(2, rounds[2][1]), (1, rounds[1][1]), (4, rounds[4][1])]
    assert sorted(tried) == sorted((p, m) for p, ms in rounds.items() for m in ms if (p, m) != (1, 1))
