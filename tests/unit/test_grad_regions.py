"""autopar/capture/grad_regions.py: ``torch.no_grad()`` regions that export wraps in a higher-order
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
from autopar.capture.trace import capture

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


class _Tables(nn.Module):
    """Rotary-like tables computed from a buffer and positions outside any no_grad
    region (transformers 5.24's Llama), a batch-shaped mask, and activations."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("inv_freq", torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        ang = torch.cat([pos[:, None] * self.inv_freq[None, :]] * 2, dim=-1)  # [seq, 8]
        cos = ang.cos().to(x.dtype)
        mask = torch.ones(x.shape[0], x.shape[1], 1)  # batch-shaped: keeps its layouts
        return ((x @ self.w) * cos * mask).sum()


def test_tables_from_buffers_alone_are_kept_replicated():
    """transformers 5.24 moved the rotary tables' cast out of the no_grad region, so they
    had every layout and the repeated-layer solver stopped clustering HF Llama
    (tests/solver/test_cluster.py failed on a fresh install). Every tensor computed from
    buffers and shapes alone is now a table; what reads the input or a parameter is not,
    nor is a batch-shaped one."""
    from autopar.capture.grad_regions import KEEP_REPLICATED

    cap = capture(_Tables(), (torch.randn(2, 6, 8),))
    marked = {n.name: bool(n.meta.get(KEEP_REPLICATED)) for n in cap.gm.graph.nodes
              if n.op == "call_function"}
    by_target = {str(n.target): marked[n.name] for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert by_target["aten.cos.default"] and by_target["aten.cat.default"], marked
    assert by_target["aten.to.dtype"], marked  # the cast the layers read
    assert not by_target["aten.ones.default"], marked  # batch-shaped
    assert not by_target["aten.matmul.default"], marked
    assert not by_target["aten.sum.default"], marked
