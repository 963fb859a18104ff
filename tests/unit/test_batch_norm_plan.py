"""A sharded batch norm (SyncBatchNorm's local form, autopar/runtime/norms.py) keeps the
running statistics of the single process on every rank; its own all-reduces are priced
by the cost model and named by ``explain``, as the cross-entropy's are.  (Its values and
gradients are checked with every other rule's by test_rules.py.)"""

from __future__ import annotations

import pytest
import torch
from autopar.cost_models import MeshSpec
from rule_samples import WITH_4
from rule_sim import local_form, mesh_coords, run_ranks, scatter, unsharded
from test_rules import built, rule_nodes
from torch import nn
from torch.distributed.tensor import Shard

from autopar.capture.annotate import annotate
from autopar.capture.ir import tensor_inputs
from autopar.capture.trace import capture
from autopar.plans.placement import R
from autopar.search.node_prices import CostModel
from autopar.sharding.local_forms import describe
from autopar.sharding.rules import RuleCtx, op_strategies

aten = torch.ops.aten
MESH = MeshSpec.preset("cpu-gloo", shape=(2,))


def _bn_node(train: bool):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).train(train)
    gm = annotate(capture(model, (torch.randn(4, 3, 6, 6),)).gm)
    node = next(n for n in gm.graph.nodes if n.target is aten.batch_norm.default)
    return node, {s.inputs[0]: s for s in op_strategies(node, RuleCtx((2,)))}


def test_batch_norm_comm_is_priced_and_explained() -> None:
    node, by_x = _bn_node(True)
    cm = CostModel(MESH)
    batch, chans, whole = by_x[(Shard(0),)], by_x[(Shard(1),)], by_x[(R,)]
    assert cm.own_comm(node, whole) == 0.0 and describe(node, whole, MESH) == ""
    # four latency-bound all-reduces of 8 per-channel sums on the batch split, two on the
    # channels split (the running statistics)
    assert cm.own_comm(node, batch) > cm.own_comm(node, chans) > 0.0
    assert "SyncBatchNorm" in describe(node, batch, MESH)
    assert "running-statistics" in describe(node, chans, MESH)


def test_eval_batch_norm_communicates_nothing() -> None:
    node, by_x = _bn_node(False)
    assert CostModel(MESH).own_comm(node, by_x[(Shard(0),)]) == pytest.approx(0.0)


@pytest.mark.parametrize("mesh", WITH_4, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("name", ["batch_norm2d_train", "batch_norm1d_train"])
def test_batch_norm_running_stats(name: str, mesh: tuple[int, ...]) -> None:
    """Every strategy of a training batch norm leaves every rank's running statistics
    (buffers updated in place, whole on every rank) equal to the single process's."""
    gm, _, env = built(name)
    for node in [n for n in rule_nodes(gm) if n.target is aten.batch_norm.default]:
        inputs = [env[x.name].detach().clone() for x in tensor_inputs(node)]
        ref = [t.clone() for t in inputs]
        unsharded(node, ref)  # updates ref's running statistics (inputs 3 and 4)
        assert not torch.equal(ref[3], inputs[3])
        for i, s in enumerate(op_strategies(node, RuleCtx(mesh))):
            gen = torch.Generator().manual_seed(i)
            local = {c: [] for c in mesh_coords(mesh)}
            for x, p in zip(inputs, s.inputs):
                for c, t in scatter(x, p, mesh, gen).items():
                    local[c].append(t)
            run_ranks(local_form(node, s, mesh), local, mesh)
            for c, ts in local.items():
                for j in (3, 4):
                    # fp64 statistics of 32 values of order one: reordered sums move them
                    # by ~1e-15; a rank that kept its own batch's statistics is off by ~0.1
                    assert torch.allclose(ts[j], ref[j], rtol=1e-12, atol=1e-12), \
                        f"{s.inputs[0]}, rank {c}, input {j}: {ts[j]} vs {ref[j]}"
