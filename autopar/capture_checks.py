"""Checks around capture for what torch.export would capture silently wrong.

A custom ``torch.autograd.Function`` is inlined by torch.export: its forward's ops
enter the graph and its backward is dropped, so the captured model trains with the
gradient of the forward's ops, not the user's backward (a straight-through estimator,
a gradient reversal, a clipped gradient ... silently change).  :func:`custom_function_guard`
watches user-defined Functions' ``forward`` while capturing and refuses such models with a
:class:`~autopar.errors.CaptureError` that names the Function and says what to do.
"""

from __future__ import annotations

import contextlib

import torch

from autopar.errors import CaptureError

_FUNCTION = torch.autograd.Function


def _is_users(cls: type) -> bool:
    # PyTorch's own Functions (checkpoint, ...) are traced correctly by export
    return not (cls.__module__ or "").startswith(("torch.", "autopar."))


def _user_functions() -> list[type]:
    out, todo = [], list(_FUNCTION.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if _is_users(cls) and "forward" in cls.__dict__:
            out.append(cls)
    return out


def _recording(cls: type, fn, seen: list[type]):
    def forward(*args, **kwargs):
        if cls not in seen:
            seen.append(cls)
        return fn(*args, **kwargs)
    return forward


@contextlib.contextmanager
def custom_function_guard():
    """Raise :class:`CaptureError` after capture if the forward applied a user-defined
    ``autograd.Function`` (see the module docstring).

    Every user-defined subclass that exists has its ``forward`` wrapped while capturing
    (``Function.apply`` itself may have been bound before, e.g. ``self.fn = Fn.apply``;
    the forward is looked up on the class at each call)."""
    seen: list[type] = []
    patched = []
    for cls in _user_functions():
        original = cls.__dict__["forward"]
        patched.append((cls, original))
        cls.forward = staticmethod(_recording(cls, original.__get__(None, cls), seen))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.forward = original
    if seen:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in seen)
        raise CaptureError(
            f"the forward applies custom autograd.Function {names}: torch.export inlines its "
            "forward and drops its backward, so the planned model would train with other "
            "gradients. Register it as a custom op with its own backward (torch.library."
            "custom_op + register_autograd): autopar then keeps it as one opaque node that "
            "runs replicated, or write it with differentiable torch ops.")


__all__ = ["custom_function_guard"]
