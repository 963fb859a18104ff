"""The cost model prices what the runtime does: the loss's reduction is off the step
(in flight until read, no backward collective), and the cross-entropy's token count
hides behind the forward."""

from __future__ import annotations

import pytest
import torch
from autopar.cost_models import all_reduce_time
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import MeshSpec
from autopar.annotate import annotate
from autopar.capture import capture
from autopar.costs import CostModel
from autopar.ir import TensorInfo, info
from autopar.strategies import enumerate_strategies
from examples.gpt import build

MESH = MeshSpec.preset("cpu-gloo", shape=(4,))


def test_a_scalar_output_sum_is_off_the_step() -> None:
    """runtime/pending.py leaves the loss's Partial -> Replicate all-reduce in flight
    (waited for only when the value is read) and computes its backward locally, so the
    model charges nothing for it (before: the forward all-reduce); any other output
    still pays the forward collective and its backward dual."""
    cm = CostModel(MESH)
    loss = TensorInfo((), torch.float32)
    logits = TensorInfo((4, 8), torch.float32)
    assert all_reduce_time(MESH, 0, 4.0) > 0
    assert cm.output_redistribution((Partial(),), (Replicate(),), loss) == 0.0
    gathered = cm.redistribution((Shard(0),), (Replicate(),), logits)
    assert gathered > 0
    assert cm.output_redistribution((Shard(0),), (Replicate(),), logits) == pytest.approx(gathered)
    assert cm.output_redistribution((Replicate(),), (Replicate(),), loss) == 0.0


def test_token_count_is_hidden_and_vocab_parallel_reductions_are_not() -> None:
    """A batch-sharded cross-entropy's token count starts at the top of the forward
    (passes/localize.py) and is priced hidden (before: exposed but for the op's own
    forward); a class-sharded one still pays its three all-reduces of a row each."""
    with torch.device("meta"):
        model, ex = build(layers=1, dim=32, heads=2, vocab=64, seq=8, batch=8)
    cap = capture(model, ex)
    annotate(cap.gm)
    node = next(n for n in cap.gm.graph.nodes
                if n.op == "call_function" and "cross_entropy" in str(n.target))
    strategies = enumerate_strategies(cap.gm, MESH.shape)[node]
    rows = next(s for s in strategies if s.inputs[0] == (Shard(0),))
    classes = next(s for s in strategies if s.inputs[0] == (Shard(1),))
    cm = CostModel(MESH)
    assert cm.own_comm(node, rows) == 0.0
    n_rows = info(node.args[0]).out.shape[0]
    assert cm.own_comm(node, classes) == pytest.approx(3 * all_reduce_time(MESH, 0, n_rows * 4.0))
