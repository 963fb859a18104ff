"""Checks around capture for what torch.export would capture silently wrong.

A custom ``torch.autograd.Function`` is inlined by torch.export: its forward's ops
enter the graph and its backward is dropped, so the captured model trains with the
gradient of the forward's ops, not the user's backward (a straight-through estimator,
a gradient reversal, a clipped gradient ... silently change).  :func:`custom_function_guard`
watches user-defined Functions' ``forward`` while capturing and refuses such models with a
:class:`~autopar.errors.CaptureError` that names the Function and says what to do.

A forward that reads a tensor's value into Python (``.item()``, ``float(t)``) and lets it
decide Python code (a branch, ``math.sqrt``) cannot be captured: export stops with a
``GuardOnDataDependentSymNode`` that names no line of the user's.  :func:`data_dependent_error`
turns it into a :class:`~autopar.errors.CaptureError` naming the forward's line.  (A value
read with ``.item()`` and used in tensor arithmetic is captured and recomputed per call:
:mod:`autopar.capture.scalar_reads`.)
"""

from __future__ import annotations

import contextlib
import linecache
import os
import types

import torch

from autopar.errors import _OURS, CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)

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


def _model_line(tb: types.TracebackType | None) -> str | None:
    """``file:line: code`` of the deepest traceback frame outside torch, autopar and the
    standard library: the model's line that made the failing call."""
    found = None
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not name.startswith((_TORCH_DIR, _STDLIB_DIR, "<", *_OURS)):
            line = linecache.getline(name, tb.tb_lineno).strip()
            found = f"{name}:{tb.tb_lineno}" + (f": {line}" if line else "")
        tb = tb.tb_next
    return found


def data_dependent_error(model: torch.nn.Module, err: BaseException) -> CaptureError | None:
    """A :class:`CaptureError` naming the model's line when ``err`` is export's failure to
    follow a tensor's value into Python control flow; ``None`` for any other error."""
    guard = getattr(torch.fx.experimental.symbolic_shapes, "GuardOnDataDependentSymNode", ())
    if not isinstance(err, guard):
        return None
    where = _model_line(err.__traceback__) or "an unknown line (no frame outside torch)"
    return CaptureError(
        f"cannot capture {type(model).__name__}: torch.export stopped where the forward reads a "
        f"tensor's value into Python, at {where}, and lets it decide Python code (a branch, math.*, float(), int() or a "
        "shape): a captured graph cannot follow a value that changes with every batch, and "
        "freezing the traced batch's value would train with the wrong number. Compute it with "
        "tensor ops instead (torch.where for a branch, torch.sqrt for math.sqrt, keep "
        "t.item() only where the number enters tensor arithmetic), or pass it as an input.")


__all__ = ["custom_function_guard", "data_dependent_error"]
