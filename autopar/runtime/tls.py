"""Collectives issued with no Python object in the thread-local state they capture.

A gloo work copies the issuing thread's ``at::ThreadLocalState``. Two things put
Python objects there while autopar's runtime issues collectives:

- ``loss.backward()`` stashes a ``contextvars.Context`` under ``"context"`` for the
  whole backward pass (torch/autograd/graph.py, ``_engine_run_backward``), so every
  gradient all-reduce, reduce-scatter or tensor-parallel backward collective holds one;
- ZeRO-3's forward runs under our ``saved_tensors_hooks`` (runtime/zero3.py), so its
  gathers hold the hook functions.

The last reference to a finished work is often dropped on gloo's worker thread (its
queue slot, or a later ``barrier`` that keeps weak references to in-flight works).
Destroying that state then takes the GIL.  ``DeviceMesh`` keeps its process groups,
and with them the worker threads, alive until interpreter exit.  If that destruction
comes after finalization has begun, Python ends the thread inside a ``noexcept``
destructor and the process aborts ("terminate called without an active exception")
after its work is done.  This was seen about once in 20 two-rank runs on a loaded
2-core machine (docs/training.md's first example under torchrun; CI went red on it).

:func:`issue` calls a collective with both lifted out of thread-local state and puts
them back afterwards.  Nothing reads them while a collective is issued.  On a torch
without the private TLS calls used here (they exist in 2.13), it calls the collective
as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

_STASH = "context"  # the key torch.autograd.graph._engine_run_backward stashes under
T = TypeVar("T")


def _hooks_api() -> Any:
    a = torch._C._autograd
    needed = ("_top_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks",
              "_push_saved_tensors_default_hooks")
    return a if all(hasattr(a, n) for n in needed) else None


def _stash_api() -> bool:
    return all(hasattr(torch._C, n) for n in
               ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls"))


def python_state() -> tuple[str, ...]:
    """The Python objects a collective issued here and now would capture, by name:
    ``"autograd context"`` and/or ``"saved-tensors hooks"`` (empty when neither)."""
    found = []
    if _stash_api() and torch._C._is_key_in_tls(_STASH):
        found.append("autograd context")
    hooks = _hooks_api()
    if hooks is not None and hooks._top_saved_tensors_default_hooks(True) is not None:
        found.append("saved-tensors hooks")
    return tuple(found)


@contextlib.contextmanager
def plain_thread_state() -> Iterator[None]:
    """Within the block, the autograd context stash and every saved-tensors hook pair
    are out of this thread's state; both are restored as they were on exit."""
    stash = None
    if _stash_api() and torch._C._is_key_in_tls(_STASH):
        stash = torch._C._get_obj_in_tls(_STASH)
        torch._C._remove_obj_from_tls(_STASH)
    hooks = _hooks_api()
    popped = []
    while hooks is not None and (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            hooks._push_saved_tensors_default_hooks(pack, unpack)
        if stash is not None:
            torch._C._stash_obj_in_tls(_STASH, stash)


def issue(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` (a ``torch.distributed`` collective) under
    :func:`plain_thread_state`."""
    with plain_thread_state():
        return fn(*args, **kwargs)


__all__ = ["issue", "plain_thread_state", "python_state"]
