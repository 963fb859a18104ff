"""ParallelModule is composed, not mixed in: its state and loop habits read the module's
one :class:`~autopar.module.parts.Parts` (planning-only modules, no process group)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

from autopar import MeshSpec, ParallelModule, auto_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mlp  # noqa: E402


def _module() -> tuple[nn.Module, ParallelModule]:
    model, ex = mlp.build()
    return model, auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                                pins={"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"})


def test_no_mixins_and_one_source_of_parts() -> None:
    assert ParallelModule.__bases__ == (nn.Module,)
    model, pm = _module()
    assert pm._state.parts is pm._parts and pm._habits.parts is pm._parts
    # the graph is held, not registered: users see the original names only
    assert "inner" not in pm._modules and pm._parts.inner is pm.inner
    # a piece replaced on the module (as apply_copies replaces the graph) is what the
    # state reads: its state dict goes through the new graph's tensors
    before = pm.full_state_dict()
    other = copy.deepcopy(pm.inner)
    with torch.no_grad():
        other.get_parameter(next(iter(pm.aliases))).add_(1.0)
    object.__setattr__(pm, "inner", other)
    assert pm._state.parts.inner is other
    t = next(iter(pm.aliases))
    name = pm.aliases[t][0]
    assert torch.equal(pm.full_state_dict()[name], before[name] + 1.0)


def test_deepcopy_keeps_the_parts_shared_within_the_copy() -> None:
    model, pm = _module()
    new = copy.deepcopy(pm)
    assert new._parts is not pm._parts
    assert new._state.parts is new._parts and new._habits.parts is new._parts
    assert new.inner is not pm.inner
    mine, theirs = new.full_state_dict(), pm.full_state_dict()
    assert mine.keys() == model.state_dict().keys()
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
