"""The cost model prices what the runtime does: the loss's reduction has no backward
collective, and the cross-entropy's token count hides behind the op's forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autopar.cost_models import all_reduce_time
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import MeshSpec
from autopar.annotate import annotate
from autopar.capture import capture
from autopar.costs import CostModel
from autopar.ir import TensorInfo
from autopar.strategies import enumerate_strategies
from examples.gpt import build

MESH = MeshSpec.preset("cpu-gloo", shape=(4,))


def test_a_scalar_output_pays_its_reduction_once() -> None:
    """passes/lower.py computes a replicated scalar output's backward locally, so the
    model charges the loss's Partial -> Replicate all-reduce once; any other output
    still pays the forward collective and its backward dual."""
    cm = CostModel(MESH)
    loss = TensorInfo((), torch.float32)
    logits = TensorInfo((4, 8), torch.float32)
    once = all_reduce_time(MESH, 0, 4.0)
    assert cm.output_redistribution((Partial(),), (Replicate(),), loss) == pytest.approx(once)
    assert cm.output_redistribution((Shard(0),), (Replicate(),), logits) == \
        pytest.approx(cm.redistribution((Shard(0),), (Replicate(),), logits))
    assert cm.output_redistribution((Replicate(),), (Replicate(),), loss) == 0.0


def test_token_count_all_reduce_hides_behind_the_forward() -> None:
    """A batch-sharded cross-entropy all-reduces its token count asynchronously while
    the log-softmax runs (runtime/ops.py): with no forward time the count is exposed
    whole, with a long one (at mesh.overlap speed) it is hidden, in between it is the
    rest."""
    with torch.device("meta"):
        model, ex = build(layers=1, dim=32, heads=2, vocab=64, seq=8, batch=8)
    cap = capture(model, ex)
    annotate(cap.gm)
    node = next(n for n in cap.gm.graph.nodes
                if n.op == "call_function" and "cross_entropy" in str(n.target))
    rows = next(s for s in enumerate_strategies(cap.gm, MESH.shape)[node]
                if s.inputs[0] == (Shard(0),))
    cm = CostModel(MESH)
    count = all_reduce_time(MESH, 0, 8.0)
    assert cm.own_comm(node, rows, 0.0) == pytest.approx(count)
    assert cm.own_comm(node, rows, 10 * count / MESH.overlap) == 0.0
    half = count / 2 / MESH.overlap
    assert cm.own_comm(node, rows, half) == pytest.approx(count / 2)
    # with communication at full speed beside compute, the same forward hides twice as much
    full = CostModel(dataclasses.replace(MESH, overlap=1.0))
    assert full.own_comm(node, rows, half) == pytest.approx(max(0.0, count - half))
