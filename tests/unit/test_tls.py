"""autopar/runtime/tls.py: collectives issued with no Python object in thread-local state.

The multi-rank side (every collective the runtime issues, on every plan the dist
suites run) is checked by tests/dist/harness.py's spy; here the helper itself: what it
takes out, and that it puts back exactly what was there.
"""

from __future__ import annotations

import torch

from autopar.runtime.tls import issue, plain_thread_state, python_state


def test_backward_context_lifted_and_restored() -> None:
    seen: dict[str, tuple[str, ...]] = {}

    def hook(_: torch.Tensor) -> None:
        seen["hook"] = python_state()
        seen["issued"] = issue(python_state)
        seen["after"] = python_state()

    x = torch.ones(3, requires_grad=True)
    x.register_post_accumulate_grad_hook(hook)
    (x * 2).sum().backward()
    assert seen["hook"] == ("autograd context",)  # what torch 2.13's backward stashes
    assert seen["issued"] == ()
    assert seen["after"] == ("autograd context",)
    assert python_state() == ()


def test_saved_tensor_hooks_lifted_and_still_used_after() -> None:
    packed: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append("outer")
        return t

    def pack_inner(t: torch.Tensor) -> torch.Tensor:
        packed.append("inner")
        return t

    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autograd.graph.saved_tensors_hooks(pack_inner, lambda t: t):
        assert python_state() == ("saved-tensors hooks",)
        with plain_thread_state():
            assert python_state() == ()
            (x * x).sum()  # saves x twice: no hook sees it here
        assert packed == []
        (x * x).sum().backward()
    # the innermost pair is back on top, the outer one under it
    assert packed == ["inner", "inner"]
    assert python_state() == ()


def test_restored_when_the_call_raises() -> None:
    def boom() -> None:
        raise RuntimeError("collective failed")

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        try:
            issue(boom)
        except RuntimeError:
            pass
        assert python_state() == ("saved-tensors hooks",)
