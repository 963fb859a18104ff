"""Layers whose forward updates state in place are never recomputed.

A training batch norm bumps its step count with ``add_`` and writes its running
statistics; checkpoint's replay of such a layer raised "modified by an inplace operation"
in backward (a forced ``recompute=`` of the blocks below, on 2 gloo ranks), and a replay
would update the statistics twice.  The search leaves them out of its candidates, and a
forced ``recompute=`` naming one is refused before anything runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import MeshSpec
from autopar.errors import PlanError

MESH = MeshSpec.preset("cpu-gloo", shape=(2,))


class Block(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8) if norm else nn.GroupNorm(2, 8)

    def forward(self, h):
        return F.relu(self.norm(self.conv(h)))


class Net(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList([Block(norm), Block(norm)])
        self.fc = nn.Linear(8, 10)

    def forward(self, x, y):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), y)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def test_forced_recompute_of_a_batch_norm_layer_is_refused():
    with pytest.raises(PlanError, match="updates state in place"):
        autopar.plan(Net(norm=True), example_inputs=_inputs(), mesh=MESH, recompute=["blocks.0"])


def test_stateless_layers_still_recompute_when_forced():
    p = autopar.plan(Net(norm=False), example_inputs=_inputs(), mesh=MESH, recompute=["blocks.0"])
    assert list(p.decisions.recompute) == ["blocks.0"]


def test_eval_batch_norm_layer_updates_no_state():
    m = Net(norm=True).eval()
    p = autopar.plan(m, example_inputs=_inputs(), mesh=MESH, recompute=["blocks.0"])
    assert list(p.decisions.recompute) == ["blocks.0"]
