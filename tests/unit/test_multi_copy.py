"""Multi-copy overlap planned and lowered (decision ``copies``): the communication the
step model hides, the search weighing copies only when asked, and the graph's order:
one copy's collective started, the other copy's ops, then the wait."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import fx

import autopar
from autopar import MeshSpec
from autopar.errors import PlanError
from autopar.runtime import collectives as C
from autopar.runtime import overlap
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.priced import Config
from autopar.search.stages.step_terms import copies_hidden
from passes.multi_copy import copy_part, mean_loss, multi_copy
from tests.dist.test_equivalence import MEGATRON

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
MESH = MeshSpec.preset("cpu-gloo", shape=(2,))


def test_hidden_by_hand() -> None:
    layers = [LayerStat("a", seconds=10.0, compute=6.0), LayerStat("b", seconds=3.0, compute=3.0)]
    # 4 s of communication, 9 s of compute at 0.35 of the link's speed beside it: 3.15 s
    assert copies_hidden(layers, Config(micro_batches=2, copies=2), MESH) == pytest.approx(3.15)
    assert copies_hidden(layers, Config(micro_batches=2), MESH) == 0.0
    gpu = MeshSpec.preset("8xH100-nvlink")  # the link runs beside the kernels: all 4 s
    assert copies_hidden(layers, Config(micro_batches=2, copies=2), gpu) == pytest.approx(4.0)
    # no compute beside: the twins wait out one drift (1 s of 2) and share half their
    # latencies (pairing 0.5 of 2 s), each half a pair's: (1 + 0.5 x 2) / 2
    twins = [LayerStat("a", seconds=4.0, compute=0.0, comm_drift=1.0, comm_latency=2.0)]
    paired = MeshSpec.from_dict({**MESH.to_dict(), "collective_pairing": 0.5})
    assert copies_hidden(twins, Config(micro_batches=2, copies=2), paired) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="collective_pairing"):
        MeshSpec.from_dict({**MESH.to_dict(), "collective_pairing": 1.5})


def _plan(**kw):
    import gpt
    model, ex = gpt.build(layers=2)
    return autopar.plan(model, example_inputs=ex, mesh=MESH, pins=MEGATRON["gpt"], **kw)


def test_copies_only_when_asked() -> None:
    plain = _plan()
    assert plain.decisions.copies == 1
    assert "copies='auto' weighs" in plain.explain("copies")
    auto = _plan(copies="auto")
    d = auto.decisions
    assert (d.copies, d.micro_batches) == (2, 2)
    assert d.step_seconds < plain.decisions.step_seconds
    why = auto.explain("copies")
    assert "2 interleaved copies" in why and "one after the other takes" in why
    assert "  copies         " in auto.summary()
    assert autopar.Plan.from_json(auto.to_json()).decisions.copies == 2
    from autopar.report.timeline import predicted_events
    assert any(e.label == "F copy 1" for e in predicted_events(auto))
    with pytest.raises(PlanError, match="copies=2"):
        _plan(copies=2, micro_batches=4)


def test_graph_order() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(torch.tanh, (x,))
    r = g.call_function(C.all_reduce, (h, 0))
    y = g.call_function(torch.sin, (r,))
    loss = g.call_function(torch.sum, (y,))
    g.output(loss)
    x.meta["val"] = torch.empty(4, 3)
    out = multi_copy(fx.GraphModule(torch.nn.Module(), g), 2)
    order = [(n.target, n.args) for n in out.graph.nodes if n.op == "call_function"]
    names = [t.__name__ if hasattr(t, "__name__") else str(t) for t, _ in order]
    # both copies' halves, A's tanh and start, B's tanh and start, then A's wait and sin
    assert names == ["copy_part", "copy_part", "tanh", "start", "tanh", "start",
                     "wait", "sin", "sum", "wait", "sin", "sum", "mean_loss"]
    starts = [a for t, a in order if t is overlap.start]
    assert all(a[0] == "all_reduce" for a in starts)
    assert copy_part(torch.arange(8.0).view(8, 1), (4, 1), 1, 2).flatten().tolist() == [4, 5, 6, 7]
    assert copy_part(torch.ones(3), (3,), 0, 2).shape == (3,)  # no batch dim: whole
    assert mean_loss(torch.tensor(1.0), torch.tensor(3.0)).item() == 2.0
