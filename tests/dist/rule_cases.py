"""Op rules that once gave silently wrong numbers (issue 64), on real gloo ranks; run by
test_rule_causes.py.  Every rank runs each case; rank 0 returns the parallel module's
loss and gradients next to the single-process model's."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset


class SoftTargets(nn.Module):
    """A classifier trained on probability targets (label smoothing written out, mixup,
    distillation): ``cross_entropy`` with a float target."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 6)

    def forward(self, x, p):
        return F.cross_entropy(self.fc(x), p)


class PaddedEmbedding(nn.Module):
    """A token embedding whose padding row (id 0, BERT's) takes no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, padding_idx=0)
        self.fc = nn.Linear(4, 1)

    def forward(self, ids):
        return self.fc(self.emb(ids)).pow(2).mean()


def _mesh() -> MeshSpec:
    reset()
    return MeshSpec.preset("cpu-gloo", shape=(2,))


def soft_targets(c: dict) -> dict:
    """Data parallel over probability targets: the mean divides by the rows."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g)
    p = torch.softmax(torch.randn(8, 6, generator=g), -1)
    return _train(SoftTargets(), (x, p), c["pins"])


def padded_embedding(c: dict) -> dict:
    """The vocabulary split (vocab-parallel embedding) with the padding id in the batch."""
    torch.manual_seed(0)
    ids = torch.randint(0, 8, (4, 6), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 0
    return _train(PaddedEmbedding(), (ids,), c["pins"])


def _train(model: nn.Module, inputs: tuple, pins: dict) -> dict:
    ref = copy.deepcopy(model)
    pm = auto_parallel(model, example_inputs=inputs, mesh=_mesh(), pins=pins)
    loss = pm(*inputs)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    grads = pm.full_grads()
    return {"loss": loss.item(), "ref": ref_loss.item(),
            "grads": {n: grads[n].tolist() for n, _ in ref.named_parameters()},
            "ref_grads": {n: p.grad.tolist() for n, p in ref.named_parameters()}}


def run(c: dict) -> dict:
    """Dispatch ``c["fn"]``."""
    return globals()[c["fn"]](c)
