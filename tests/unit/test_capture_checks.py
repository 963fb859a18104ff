"""Custom autograd Functions: torch.export inlines the forward and drops the backward.

Before this check, a model whose Function has a reversed backward (``-grad``) was
planned and trained with the opposite gradient sign, silently.  Now capture refuses it
and names the Function; the same computation as a ``torch.library`` custom op with its
own backward stays one opaque node, runs replicated, and keeps its gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import CaptureError


class Reverse(torch.autograd.Function):
    """Identity forward, negated gradient (gradient reversal)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g


@torch.library.custom_op("autopar_test::reverse", mutates_args=())
def reverse_op(x: torch.Tensor) -> torch.Tensor:
    """The same as a custom op."""
    return x.clone()


@reverse_op.register_fake
def _(x):
    return torch.empty_like(x)


reverse_op.register_autograd(lambda ctx, g: -g)


class Net(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x)).pow(2).mean()


def test_custom_autograd_function_is_refused_by_name() -> None:
    with pytest.raises(CaptureError, match="Reverse.*drops its backward"):
        autopar.plan(Net(Reverse.apply), (torch.randn(4, 8),), (2,))


def test_custom_op_keeps_its_backward() -> None:
    from autopar.capture.trace import capture

    x = torch.randn(4, 8)
    model = Net(reverse_op)
    cap = capture(model, (x,))
    assert any("reverse" in str(n.target) for n in cap.gm.graph.nodes)  # one opaque node
    cap.gm(x)[0].backward()
    model(x).backward()
    for (n, p), q in zip(model.named_parameters(), cap.gm.parameters()):
        assert torch.allclose(p.grad, q.grad), n  # the reversed gradient, in both


def test_torch_own_functions_are_allowed() -> None:
    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=True).sum()

    from autopar.capture.trace import capture

    capture(Ckpt(), (torch.randn(2, 8, requires_grad=True),))


def test_capture_skips_stack_traces_and_puts_the_switch_back() -> None:
    """Capture turns off export's per-op stack recording (nothing reads it) and leaves
    torch's switch as it found it, whichever way that was."""
    import torch

    from autopar.capture.trace import capture

    cfg = torch.fx.config
    for before in (False, True):
        cfg.do_not_emit_stack_traces = before
        try:
            cap = capture(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
        finally:
            after, cfg.do_not_emit_stack_traces = cfg.do_not_emit_stack_traces, False
        assert after is before
        calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
        assert calls and not any(n.meta.get("stack_trace") for n in calls)
