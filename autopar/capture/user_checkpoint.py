"""The user's own activation checkpointing, seen through capture.

``torch.export`` (non-strict) runs ``torch.utils.checkpoint.checkpoint(fn, *args,
use_reentrant=False)`` as a plain call: its saved-tensor hooks change nothing traced,
so ``fn``'s ops enter the graph like any others and nothing in the graph says they were
checkpointed (no ``tag_activation_checkpoint`` higher-order op: that is Dynamo's,
strict export and ``torch.compile`` only).  Hugging Face's
``model.gradient_checkpointing_enable()`` goes the same way: each decoder layer's
``forward`` runs through ``functools.partial(checkpoint, use_reentrant=False)``.

:func:`checkpoint_regions` marks them while exporting: every call of torch's
checkpoint (found through ``torch.utils.checkpoint``'s own generator and
``CheckpointFunction``, which every call reaches, however the user imported
``checkpoint``) runs its function under ``torch.fx.traceback.annotate``, so each op
traced inside carries ``node.meta["custom"][KEY]`` = the region's number.  Reentrant
checkpointing (``use_reentrant=True``, Hugging Face's default before transformers 5)
runs its function under ``no_grad`` in the forward, which export would capture as it
is (no gradient through the region, silently): while exporting it runs the function
as a plain call instead, with reentrant checkpointing's gradients.  A Hugging Face
model captured in eval mode (``from_pretrained`` returns it so) runs no checkpoint: the
layers its training would checkpoint (:func:`idle_hf_layers`) are marked all the same.  :func:`region_of` reads it back;
the search takes the layers those ops belong to as recomputed
(:attr:`autopar.search.stages.layer_stats.LayerStat.checkpointed`).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import fx, nn
from torch.fx import traceback as fx_traceback

KEY = "autopar_user_checkpoint"
"""Key in ``node.meta["custom"]``: the number of the user's checkpoint region the op ran in."""


class Coverage(enum.Enum):
    """How much of a layer's ops the user's checkpoint regions hold."""

    NONE = "none"
    WHOLE = "whole"  # every op of the layer (HF's gradient checkpointing, a block checkpointed)
    PART = "part"  # some of them (e.g. only the MLP): autopar recomputes the whole layer


def _marking(numbers: Iterator[int]) -> contextlib.ExitStack:
    """Entered: the ops traced from now on carry the next region's number.  Node meta
    (where annotate writes) is recorded only while preserved: within regions alone, so
    the rest of the capture is traced exactly as before."""
    stack = contextlib.ExitStack()
    stack.enter_context(fx_traceback.preserve_node_meta())
    stack.enter_context(fx_traceback.annotate({KEY: next(numbers)}))
    return stack


def idle_hf_layers(model: nn.Module) -> list[nn.Module]:
    """Hugging Face layers whose gradient checkpointing is on but idle because the model
    is in eval mode (``from_pretrained`` leaves it there; HF checkpoints only while
    ``training``): the training the plan is for will checkpoint them."""
    return [m for m in model.modules()
            if not m.training and getattr(m, "gradient_checkpointing", False) is True
            and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]


@contextlib.contextmanager
def checkpoint_regions(model: nn.Module):
    """While exporting ``model``, mark the ops each ``torch.utils.checkpoint`` call
    traces, and each of :func:`idle_hf_layers`, with its region's number (see the module
    docstring); torch's own functions are put back afterwards."""
    original = torch_checkpoint._checkpoint_without_reentrant_generator
    numbers = itertools.count()

    def marked(fn, *args, **kwargs):
        inner = original(fn, *args, **kwargs)
        next(inner)  # torch's set-up before the checkpointed function
        try:
            with _marking(numbers):
                yield  # checkpoint() calls the function here
        except BaseException as e:  # noqa: BLE001 - torch's generator sees it, as without us
            inner.throw(e)
            raise
        yield from inner  # torch's tear-down

    class Reentrant:
        """Stands in for ``CheckpointFunction`` (``use_reentrant=True``), whose forward
        runs the function under ``no_grad``: exported as it is, the region's results
        would come out detached and nothing before or inside it would get a gradient."""

        @staticmethod
        def apply(function, preserve_rng_state, *args):
            del preserve_rng_state  # (no random draw is replayed while tracing)
            # reentrant checkpointing's gradients: its outputs need one only when an
            # input tensor does (else torch warns and the region's parameters get none)
            needs = torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            if not needs:
                with torch.no_grad():
                    return function(*args)
            with _marking(numbers):
                return function(*args)

    open_regions: list[contextlib.ExitStack] = []
    hooks = [h for m in idle_hf_layers(model) for h in (
        m.register_forward_pre_hook(lambda *_: open_regions.append(_marking(numbers))),
        m.register_forward_hook(lambda *_: open_regions.pop().close()))]
    reentrant = torch_checkpoint.CheckpointFunction
    torch_checkpoint._checkpoint_without_reentrant_generator = marked
    torch_checkpoint.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = original
        torch_checkpoint.CheckpointFunction = reentrant
        for h in hooks:
            h.remove()
        while open_regions:  # a forward that raised inside a layer
            open_regions.pop().close()


def region_of(node: fx.Node) -> int | None:
    """The number of the user's checkpoint region ``node`` was traced in, or ``None``."""
    custom = node.meta.get("custom")
    return custom.get(KEY) if isinstance(custom, dict) else None


def coverage(ops: int, checkpointed: int) -> Coverage:
    """A layer's :class:`Coverage` from its count of ops and of those in a region."""
    if not checkpointed:
        return Coverage.NONE
    return Coverage.WHOLE if checkpointed == ops else Coverage.PART


__all__ = ["KEY", "Coverage", "checkpoint_regions", "coverage", "idle_hf_layers", "region_of"]
