"""A sharded batch norm's own all-reduces (SyncBatchNorm, autopar/runtime/norms.py) are
priced by the cost model and named by ``explain``, as the cross-entropy's are."""

from __future__ import annotations

import pytest
import torch
from autopar.cost_models import MeshSpec
from torch import nn

from autopar.capture.annotate import annotate
from autopar.capture.trace import capture
from autopar.plan.placement import R, Shard
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
