"""``plan.collectives()`` without ranks: what it lists follows from the plan's
placements and sizes (the comparison with what really runs is
tests/dist/test_step_collectives.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import MeshSpec
from autopar.plans.data import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

from tests.dist.test_equivalence import MEGATRON  # noqa: E402

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


@pytest.fixture(scope="module")
def model():
    return gpt.build(layers=2, dim=64, heads=4, vocab=128, seq=16, batch=8)


def _plan(model, **kw) -> Plan:
    m, ex = model
    return autopar.plan(m, ex, mesh=MeshSpec.preset("cpu-gloo", shape=(4,)), pipeline_stages=1, **kw)


def test_data_parallel_reduces_every_gradient_once(model) -> None:
    p = _plan(model, pins=DP)
    grads = sum(q.numel() * q.element_size() for q in model[0].parameters())
    buckets = [c for c in p.collectives() if c.what.startswith("gradient bucket")]
    assert buckets and all(c.kind == "all_reduce" and c.phase == "backward" and c.group == 4
                           for c in buckets)
    assert sum(c.bytes for c in buckets) == grads
    # a ring all-reduce sends 2(p-1)/p of the tensor: the data-parallel minimum
    assert sum(c.wire_bytes() for c in buckets) == pytest.approx(2 * 3 / 4 * grads)
    # nothing but the loss's sum and the token count in the forward
    assert {c.what for c in p.collectives() if c.phase == "forward"} == {
        "output cross_entropy_loss", "cross_entropy_loss target count"}


def test_zero3_keeping_a_layer_gathered_drops_its_regather(model) -> None:
    """Kept layers (``decisions.zero_kept``: all of this small model, memory allowing)
    gather once in forward and reduce-scatter; the others gather again in backward."""
    p = _plan(model, pins=DP, zero_stage=3)
    kept = set(p.decisions.zero_kept)
    assert kept >= {"blocks.0", "blocks.1"}
    zero = [c for c in p.collectives() if c.what.startswith("ZeRO-3")]
    for key in {c.what.split()[1] for c in zero}:
        mine = sorted((c.phase, c.kind) for c in zero if c.what.split()[1] == key)
        assert mine == ([("backward", "reduce_scatter"), ("forward", "all_gather")] if key in kept else
                        [("backward", "all_gather"), ("backward", "reduce_scatter"), ("forward", "all_gather")])


def test_zero3_gathers_a_layer_twice_and_reduce_scatters_it(model) -> None:
    p = _plan(model, pins=DP, zero_stage=3, reshard_after_forward=True)
    assert p.decisions.zero_kept == []
    zero = [c for c in p.collectives() if c.what.startswith("ZeRO-3")]
    layers = {c.what.split()[1] for c in zero}
    assert layers >= {"blocks.0", "blocks.1"}
    for key in layers:
        mine = sorted((c.phase, c.kind) for c in zero if c.what.split()[1] == key)
        assert mine == [("backward", "all_gather"), ("backward", "reduce_scatter"),
                        ("forward", "all_gather")]
    # gloo's reduce-scatter is an all-reduce of its input: twice a ring reduce-scatter
    rs = next(c for c in zero if c.kind == "reduce_scatter")
    assert rs.wire_bytes(True) == pytest.approx(2 * rs.wire_bytes())
    # no gradient bucket: every gradient is reduce-scattered with its layer
    assert not [c for c in p.collectives() if c.what.startswith("gradient bucket")]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_one_axis_reduces_each_bucket_once_over_the_other(model, stage: int) -> None:
    """HSDP-like ZeRO-1/2 (sharded over axis 0, replicated over axis 1): the runtime
    issued one blocking all-reduce over axis 1 per parameter (75 collectives a step,
    1.7x DDP's step on a 4-layer GPT).  Now ZeRO-2 all-reduces each bucket's part over
    axis 1 once, and ZeRO-1 reduces a bucket over both axes in one all-reduce."""
    m, ex = model
    p = autopar.plan(m, ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2, 2)), pipeline_stages=1,
                     pins={"*": "RR", "input:0": "S(0)S(0)", "input:1": "S(0)S(0)"},
                     zero_stage=stage, zero_axes=[0])
    back = [c for c in p.collectives() if c.phase == "backward"]
    zero = [c for c in back if c.what.startswith(f"ZeRO-{stage} bucket") and " over " not in c.what]
    others = [c for c in back if c.what.startswith(f"ZeRO-{stage} bucket") and " over " in c.what]
    assert zero and len(back) == len(zero) + len(others)
    if stage == 1:
        assert not others and all(c.axes == (0, 1) and c.kind == "all_reduce" for c in zero)
    else:
        assert all(c.axes == (0,) and c.kind == "reduce_scatter" for c in zero)
        assert len(others) == len(zero) and all(c.axes == (1,) for c in others)
        # each rank's part: half of every (padded) gradient, reduced over the second axis
        assert sum(c.bytes for c in others) == sum(c.bytes for c in zero) // 2


def test_micro_batches_repeat_forward_and_backward_collectives(model) -> None:
    one, two = _plan(model, pins=DP), _plan(model, pins=DP, micro_batches=2)
    fwd = {c.what: c.count for c in two.collectives() if c.phase == "forward"}
    # the ranks agree on the call's shapes once a call, before its micro-batches are cut
    assert fwd.pop("the call's shapes") == 1
    assert fwd and set(fwd.values()) == {2}
    assert {c.count for c in one.collectives()} == {1}
    assert "the call's shapes" not in {c.what for c in one.collectives()}  # data parallel: none


def test_shape_agreement_listed_where_activations_cross_ranks(model) -> None:
    """Tensor parallelism under batch="global" exchanges activations, so its ranks
    compare the call's shapes (an all-gather of each rank's input dims over every rank,
    module/shapes.py); data parallel exchanges only gradients and lists none."""
    m, ex = model
    tp = autopar.plan(m, ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                      pins=MEGATRON["gpt"], pipeline_stages=1, micro_batches=1)
    shapes = [c for c in tp.collectives() if c.what == "the call's shapes"]
    dims = sum(t.dim() for t in ex)
    assert [(c.kind, c.group, c.bytes, c.count) for c in shapes] == [("all_gather", 2, 8 * (2 + dims), 1)]


def test_round_trips_through_json(model) -> None:
    p = _plan(model, pins=DP, zero_stage=2)
    assert Plan.from_json(p.to_json()).collectives() == p.collectives()
    assert any(c.phase == "step" and c.kind == "all_gather" for c in p.collectives())


def test_pipeline_stages_list_their_own_and_messages(model) -> None:
    m, ex = model
    p = autopar.plan(m, ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)), pipeline_stages=2,
                     micro_batches=2, schedule="1f1b")
    first, last = p.collectives(stage=0), p.collectives(stage=1)
    assert {c.stage for c in p.collectives()} == {0, 1}
    # the residual stream crosses once per micro-batch each way; sends match receives
    sends = sorted((c.bytes, c.count, c.phase) for c in first if c.kind == "send")
    recvs = sorted((c.bytes, c.count, c.phase) for c in last if c.kind == "recv")
    assert sends and sends == [(b, n, "forward") for b, n, _ in sends]
    assert sorted(b for b, _, _ in sends) == sorted(b for b, _, ph in recvs if ph == "forward")
    assert all(n == 2 for _, n, _ in sends)
    # the loss's sum happens where the loss is: the last stage
    assert not [c for c in first if c.what.startswith("output")]
    assert {c.kind for c in first if c.phase == "step"} == {"broadcast"}


class _LossAndLogits(__import__("torch").nn.Module):
    """A language model that returns ``{"loss", "logits"}``, as a Hugging Face
    ``...ForCausalLM`` called with labels does."""

    def __init__(self) -> None:
        super().__init__()
        import torch
        self.emb = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids, labels):
        import torch.nn.functional as F
        logits = self.head(self.emb(ids))
        return {"loss": F.cross_entropy(logits.view(-1, 32), labels.view(-1)), "logits": logits}


def test_returned_logits_are_gathered_without_a_backward_dual() -> None:
    import hf_llama

    # a Hugging Face Llama called with labels, the global batch on every rank: the
    # caller gets the whole logits beside the loss
    m, _, batch = hf_llama.build(hidden=64, layers=1, heads=4, kv_heads=2, vocab=128, batch=8, seq=16)
    p = autopar.plan(m, (), example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=(4,)),
                     pins=DP, pipeline_stages=1)
    out = [c for c in p.collectives() if c.what.startswith("output") and c.kind != "all_reduce"]
    # the logits are gathered for the caller in the forward ...
    assert [(c.phase, c.kind) for c in out] == [("forward", "all_gather")]
    # ... and nothing flows back through that gather: the step differentiates the loss
    # (the reduce-scatter listed here before never ran: tests/dist/test_step_collectives.py)
    assert [c.what for c in p.collectives() if c.phase == "backward"
            and not c.what.startswith("gradient")] == []


def test_gradient_flow_marks_the_loss_path() -> None:
    import torch

    from autopar.capture.annotate import annotate
    from autopar.capture.grad_flow import differentiated
    from autopar.capture.ir import info
    from autopar.capture.trace import capture

    ids, labels = torch.randint(0, 32, (8, 4)), torch.randint(0, 32, (8, 4))
    gm = annotate(capture(_LossAndLogits(), (ids, labels)).gm)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss, logits = out
    assert differentiated(gm) == {loss}
    assert info(loss).returned_grad and not info(logits).returned_grad
    # the logits feed the loss, so they receive a gradient; the integer labels do not
    assert info(logits).backward
    assert not any(info(n).backward for n in gm.graph.nodes if n.op == "placeholder")


class _Classifier(nn.Module):
    """A linear classifier whose loss ignores class 0 (``torch.export`` then writes the
    cross-entropy's optional arguments positionally: ``(x, y, None, 1, 0)``)."""

    def __init__(self, ignore_index: int) -> None:
        super().__init__()
        self.lin, self.ignore_index = nn.Linear(8, 5), ignore_index

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y, ignore_index=self.ignore_index)


@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_target_count_listed_whatever_the_loss_arguments(ignore_index: int) -> None:
    """The runtime sums the count of non-ignored targets over the batch axes (the
    generated forward's ``start_count``) however the loss was called; the listing read
    the weight argument as the reduction and left the count out once ``ignore_index``
    was passed."""
    torch.manual_seed(0)
    ex = (torch.randn(8, 8), torch.randint(0, 5, (8,)))
    pm = autopar.auto_parallel(_Classifier(ignore_index), example_inputs=ex,
                               mesh=MeshSpec.preset("cpu-gloo", shape=(2,)), pins=DP)
    assert "start_count" in pm.code  # what runs
    counts = [c for c in pm.plan.collectives() if c.what.endswith("target count")]
    assert len(counts) == 1 and counts[0].bytes == 8 and counts[0].group == 2
