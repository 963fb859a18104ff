"""Measure tensor memory on CPU: activations saved for backward and peak bytes.

CPU has no allocator statistics like ``torch.cuda.max_memory_allocated`` and RSS is
too noisy for small models (the allocator keeps freed pages, Python and the libraries
move it by megabytes).  Instead :class:`MemoryTracker` watches every aten op through a
``TorchDispatchMode``: an output whose storage is not one of the op's inputs' storages
is a fresh allocation; it counts ``storage.nbytes()`` once per storage (views and
in-place results share their input's storage and are not counted) and holds only a
weak reference, so it sees the storage die.  Live bytes are re-counted before each op
and after each allocation, so the peak is exact at op granularity: it misses only
scratch memory a kernel allocates and frees inside one op (not a tensor to Python).
Collectives are dispatcher ops too (``c10d.allreduce_`` ...), so buffers they
allocate through aten ops are counted; gloo's internal staging buffers are not.

Only storages allocated *inside* the measured call are tracked; memory that exists
before it (parameters, optimizer state, inputs) is added by the caller through
``baseline`` (see :func:`tensor_bytes`).

``saved_activation_bytes`` counts what the autograd graph keeps alive after a forward:
storages allocated during the forward and still alive when it returns, less those of
its outputs.  This is the activation memory a memory model predicts, including the
inputs a ``torch.utils.checkpoint`` region keeps for recomputation; counting with
``torch.autograd.graph.saved_tensors_hooks`` instead would miss those (the checkpoint's
own hooks shadow outer ones and its inputs are held by its frame, not saved) and would
count parameters saved by ops such as ``linear``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_ref(t: torch.Tensor) -> StorageWeakRef | None:
    if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
        return None
    return StorageWeakRef(t.untyped_storage())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages count once)."""
    seen: dict[StorageWeakRef, int] = {}
    for t in tensors:
        # a DTensor (parameters, their gradients and optimizer state) is a wrapper: its
        # memory is its local shard's
        t = getattr(t, "_local_tensor", t)
        ref = _storage_ref(t)
        if ref is not None:
            seen.setdefault(ref, t.untyped_storage().nbytes())
    return sum(seen.values())


def module_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of ``module``'s parameters, buffers, existing gradients and kept gradient
    buffers, plus the optimizer's state tensors: the memory a training step starts
    from."""
    mods = [module]
    inner = getattr(module, "inner", None)  # a ParallelModule's graph holds the local tensors
    if isinstance(inner, torch.nn.Module):
        mods.append(inner)
    ts: list[torch.Tensor] = []
    for m in mods:
        ts += [*m.parameters(), *m.buffers()]
    # gradients as the user sees them: a ParallelModule drops the local gradients of
    # parameters whose (DTensor) gradient the user set to None at its next forward
    ts += [p.grad for p in module.parameters() if p.grad is not None]
    # and the gradient buffers a ParallelModule keeps between steps (runtime/grad_sync.py)
    sync = getattr(module, "grad_sync", None)
    ts += [b.flat for b in getattr(sync, "buckets", ()) if b.flat is not None]
    if optimizer is not None:
        ts += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(ts)


class MemoryTracker(TorchDispatchMode):
    """Track storages allocated by aten ops while active (see the module docstring).

    ``live`` is the bytes of tracked storages alive now, ``peak`` the most ever alive
    at once (both exclude memory that existed before entering).
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[StorageWeakRef, int] = {}
        self._live = 0
        self.peak = 0

    def _sweep(self) -> None:
        dead = [r for r in self._sizes if r.expired()]
        for r in dead:
            self._live -= self._sizes.pop(r)

    @property
    def live(self) -> int:
        """Bytes of tracked storages alive now."""
        self._sweep()
        return self._live

    def alive(self) -> set[StorageWeakRef]:
        """Weak references to the tracked storages that are alive now."""
        self._sweep()
        return set(self._sizes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``func``; record the storages its outputs newly allocated."""
        kwargs = kwargs or {}
        self._sweep()
        out = func(*args, **kwargs)
        # a storage freed inside func may have its address reused by an output: drop
        # the dead entry first, or the output would look already tracked
        self._sweep()
        inputs = {r for r in map(_storage_ref, pytree.tree_leaves((args, kwargs))) if r is not None}
        for t in pytree.tree_leaves(out):
            ref = _storage_ref(t)
            if ref is None or ref in inputs or ref in self._sizes:
                continue
            n = t.untyped_storage().nbytes()
            self._sizes[ref] = n
            self._live += n
        self.peak = max(self.peak, self._live)
        return out


def peak_bytes(fn: Callable[[], Any], baseline: int = 0) -> int:
    """Peak tensor bytes while running ``fn()``: ``baseline`` (memory held before the
    call, e.g. :func:`module_state_bytes`) plus the most bytes allocated during the
    call that were alive at the same time.

    Example, one training step of a model on one rank::

        peak = peak_bytes(lambda: (model(*batch).backward(), opt.step()),
                          baseline=module_state_bytes(model, opt) + tensor_bytes(batch))
    """
    with MemoryTracker() as m:
        fn()
    return baseline + m.peak


def saved_activation_bytes(fn: Callable[[], Any]) -> int:
    """Bytes the autograd graph keeps for backward after the forward ``fn()``:
    storages allocated during ``fn`` that are still alive when it returns, less the
    storages of what it returns (deduplicated by storage).  ``fn``'s result is
    released afterwards, which frees the graph unless the caller kept a reference.

    Example: ``saved_activation_bytes(lambda: model(*batch))``.
    """
    with MemoryTracker() as m:
        out = fn()
    outs = {r for r in map(_storage_ref, pytree.tree_leaves(out)) if r is not None}
    return sum(m._sizes[r] for r in m.alive() - outs)


__all__ = ["MemoryTracker", "module_state_bytes", "peak_bytes", "saved_activation_bytes", "tensor_bytes"]
