"""passes/grad_regions.py: ``torch.no_grad()`` regions that export wraps in a higher-order
op are inlined with their results detached, so they are planned like any op and a
Hugging Face model's module exports (the region's sub-module was no tensor to write)."""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.capture import capture

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


class _NoGradMix(nn.Module):
    """A gradient path through ``w`` and a no_grad region fed by the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = (x @ self.w).sigmoid()  # a table: no gradient may flow through it
        return ((x @ self.w) * scale).sum()


def _regions(gm) -> int:
    return sum(getattr(n.target, "__name__", "") == "wrap_with_set_grad_enabled"
               for n in gm.graph.nodes)


def test_no_grad_region_inlined_and_detached():
    torch.manual_seed(0)
    m = _NoGradMix()
    x = torch.randn(3, 4)
    gm = capture(m, (x,)).gm
    assert _regions(gm) == 0
    assert not any(isinstance(v, torch.fx.GraphModule) for v in gm.children())
    m.zero_grad()
    ref = m(x)
    ref.backward()
    want = m.w.grad.clone()
    w = gm.get_parameter("w")
    w.grad = None
    (got,) = gm(x)  # the captured graph returns its flat outputs
    got.backward()
    torch.testing.assert_close(got, ref)
    # a region left differentiable would add the sigmoid's gradient here
    torch.testing.assert_close(w.grad, want)


def test_hf_llama_rotary_planned_and_exported():
    import hf_zoo

    model, batch = hf_zoo.build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = auto_parallel(model, example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)))
    assert not any("wrap_with_set_grad_enabled" in w for w in pm.plan.warnings)
    with tempfile.TemporaryDirectory() as d:
        pm.export(d)  # raised AttributeError on the region's sub-module before
        src = (Path(d) / "module.py").read_text()
    assert "submod" not in src and "rotary" in src
