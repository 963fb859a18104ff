"""Recomputation pass and memory measurement, single process.

Exactness: a recomputed layer runs the same aten ops on the same inputs in the same
order, forward and again in backward, with deterministic CPU kernels, so the loss and
every gradient are compared bitwise (``torch.equal``), not within a tolerance.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from autopar.cost_models import MeshSpec
from autopar.passes.lower import lower
from autopar.passes.recompute import RecomputeError, checkpoint, recompute
from torch import fx, nn

from autopar.capture.annotate import annotate
from autopar.capture.trace import capture
from autopar.plans.decisions import PlanOptions
from autopar.runtime.memstats import (
    MemoryTracker,
    module_state_bytes,
    peak_bytes,
    saved_activation_bytes,
    tensor_bytes,
)
from autopar.search.op_placement import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

F32 = 4


@pytest.fixture(scope="module")
def lowered() -> tuple[fx.GraphModule, tuple[torch.Tensor, ...]]:
    """GPT with 4 blocks lowered on a 1-device mesh (no collective is inserted, so it runs
    without a process group)."""
    model, ex = gpt.build(layers=4)
    cap = capture(model, ex)
    annotate(cap.gm)
    plan = make_plan(cap.gm, MeshSpec.preset("cpu-gloo", shape=(1,)), cap.aliases, PlanOptions())
    return lower(cap.gm, plan), ex


def _loss_and_grads(gm: fx.GraphModule, ex) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in gm.parameters():
        p.grad = None
    loss = gm(*ex)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in gm.named_parameters()}


def test_recompute_is_exact_and_saves_the_blocks_activations(lowered) -> None:
    base, ex = lowered
    ref = copy.deepcopy(base)
    gm = recompute(copy.deepcopy(base), {"blocks.1", "blocks.2"})

    # the pass introduces no parameters: the submodules take them as inputs
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in ref.named_parameters()]
    calls = [n for n in gm.graph.nodes if n.target is checkpoint]
    assert [n.meta["autopar_layer"] for n in calls] == ["blocks.1", "blocks.2"]
    assert "checkpoint(recompute_blocks_1" in gm.code
    assert not any(n.meta.get("autopar_layer") in ("blocks.1", "blocks.2")
                   for n in gm.graph.nodes if n.op == "call_function" and n not in calls)

    loss, grads = _loss_and_grads(gm, ex)
    ref_loss, ref_grads = _loss_and_grads(ref, ex)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name

    full = saved_activation_bytes(lambda: ref(*ex))
    two = saved_activation_bytes(lambda: gm(*ex))
    every = recompute(copy.deepcopy(base), {f"blocks.{i}" for i in range(4)})
    four = saved_activation_bytes(lambda: every(*ex))
    per_block = (full - two) // 2
    # identical blocks: recomputing any one of them saves the same bytes, all four save 4x
    assert full - four == 4 * per_block
    # blocks hold most of the activations: 2 of 4 recomputed cuts roughly their share
    # (the rest is the embeddings, the head's logits and the loss)
    assert 0.35 * full < full - two < 0.5 * full
    # what a recomputed block still keeps is its input, [batch, seq, dim] fp32, which
    # the next layer's layer_norm saved anyway: the saving is the block's whole interior
    b, t = ex[0].shape
    assert per_block > 10 * b * t * gpt.GPTConfig().dim * F32


def test_recompute_reads_module_stack_on_a_captured_graph() -> None:
    model, ex = gpt.build(layers=2)
    gm = capture(model, ex).gm
    ref = copy.deepcopy(gm)
    recompute(gm, {"blocks.0"})
    assert hasattr(gm, "recompute_blocks_0")
    assert torch.equal(gm(*ex)[0], ref(*ex)[0])


def test_recompute_errors_clearly(lowered) -> None:
    base, _ = lowered
    with pytest.raises(RecomputeError, match="layers: .*blocks.3"):
        recompute(copy.deepcopy(base), {"blocks.9"})
    gm = copy.deepcopy(base)
    inner = [n for n in gm.graph.nodes if n.meta.get("autopar_layer") == "blocks.1" and n.op == "call_function"]
    inner[3].meta["autopar_layer"] = "blocks.2"
    with pytest.raises(RecomputeError, match=f"not contiguous.*{inner[3].name}"):
        recompute(gm, {"blocks.1"})


def test_saved_activation_bytes_of_a_linear_chain() -> None:
    # tanh saves its output for backward; linear saves its input (the user's x or the
    # previous tanh output) and its weight (a parameter, existing before the forward)
    b, d0, d1, d2 = 16, 32, 64, 48
    m = nn.Sequential(nn.Linear(d0, d1), nn.Tanh(), nn.Linear(d1, d2), nn.Tanh())
    x = torch.randn(b, d0)
    assert saved_activation_bytes(lambda: m(x).sum()) == (b * d1 + b * d2) * F32
    with torch.no_grad():
        assert saved_activation_bytes(lambda: m(x).sum()) == 0


def test_peak_bytes_counts_live_storages() -> None:
    def fn() -> None:
        a = torch.empty(1000)
        b = torch.empty(2000)
        v = b.view(40, 50)  # a view allocates nothing
        del a
        c = torch.empty(500)
        del b, v, c

    assert peak_bytes(fn) == 3000 * F32
    assert peak_bytes(fn, baseline=7) == 3000 * F32 + 7
    # no-grad forward of a linear chain: the peak is two [b, d1] tensors at the first
    # tanh (its input and output alive together)
    b, d0, d1, d2 = 16, 32, 64, 48
    m = nn.Sequential(nn.Linear(d0, d1), nn.Tanh(), nn.Linear(d1, d2), nn.Tanh())
    x = torch.randn(b, d0)
    with torch.no_grad():
        assert peak_bytes(lambda: m(x)) == 2 * b * d1 * F32
    with MemoryTracker() as t:
        y = m(x)
    # alive after a grad forward: both tanh outputs (y is the second one)
    assert t.live == (b * d1 + b * d2) * F32 == tensor_bytes([y]) + b * d1 * F32
    assert module_state_bytes(m) == sum(p.numel() for p in m.parameters()) * F32


def test_parameter_side_nodes_move_into_the_segment(lowered) -> None:
    # as ZeRO-3 does with zero_gather: a node reading only a parameter, emitted at the
    # top of the graph next to its get_attr, tagged with its user's layer
    base, ex = lowered
    ref = copy.deepcopy(base)
    gm = copy.deepcopy(base)
    g = gm.graph
    w = next(n for n in g.nodes if n.op == "get_attr" and n.target == "blocks.1.mlp.fc1.weight")
    with g.inserting_after(w):
        gathered = g.call_function(torch.ops.aten.clone.default, (w,))
    w.replace_all_uses_with(gathered, delete_user_cb=lambda u: u is not gathered)
    gathered.meta["autopar_layer"] = "blocks.1"
    gm.recompile()
    recompute(gm, {"blocks.1"})
    body = [n.target for n in gm.recompute_blocks_1.graph.nodes]
    assert torch.ops.aten.clone.default in body
    assert "blocks_1_mlp_fc1_weight" in [n.name for n in gm.recompute_blocks_1.graph.nodes]
    loss, grads = _loss_and_grads(gm, ex)
    ref_loss, ref_grads = _loss_and_grads(ref, ex)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
