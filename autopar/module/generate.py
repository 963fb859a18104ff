"""``pm.generate``: Hugging Face's ``generate`` of the model passed to ``auto_parallel``,
with the module's trained weights.

Decoding calls the model once per new token on shapes the plan never saw (one token
against a KV cache that grows each step), under control flow that lives outside any
graph (stopping criteria, the cache).  So, as FSDP's ``summon_full_params`` does for
work outside the sharded forward, every rank gathers the whole state
(:meth:`~autopar.module.parallel.ParallelModule.full_state_dict`, collective) into a working
copy of the original model on its own device and runs that model's own ``generate``
there, in eval mode under ``torch.no_grad``.

The copy is kept between calls and loaded again only when a parameter or buffer of the
module changed since (an optimizer step, an in-place write, ``load_state_dict``): torch
bumps a tensor's version on every in-place write.  A DTensor parameter counts only the
writes through it; the local tensor the graph reads (this rank's shard, which an
optimizer step on the local tensors and ZeRO's loads write,
:class:`~autopar.runtime.dparams.Entry`) and its host copy under offload count their
own, so all of them are read.  The ranks agree on "changed" with one all-reduce of a
flag (a rank's versions may move without another's: ZeRO shards of different sizes),
so every rank gathers or none does, and a generate in an eval loop costs one gather per
change of the weights, not one per call.  The copy is a whole model on every rank, which
the plan's memory budget does not hold during training: the next forward of the module
with gradients enabled (training resumed) frees it
(:meth:`~autopar.module.parallel.ParallelModule.forward`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopar.errors import GenerateError
from autopar.module.habits import building

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule

_INSTEAD = ("pm.generate runs the Hugging Face generate() of the model passed to "
            "auto_parallel(model, ...) under a process group (torchrun), with pm's trained "
            "weights.  Otherwise gather the weights on every rank with state = "
            "pm.full_state_dict() and call generate on a model of your own after "
            "model.load_state_dict(state)")


@dataclass
class Working:
    """The working copy of the original model ``generate`` runs, and the versions of
    the module's tensors it was last loaded from."""

    model: nn.Module
    versions: tuple[int, ...]


def _origin(pm: ParallelModule) -> nn.Module:
    """The model passed to ``auto_parallel``, or :class:`GenerateError` (the same on
    every rank: it depends on nothing a rank holds alone)."""
    if pm._mesh_rt is None:
        raise GenerateError(f"pm.generate: this ParallelModule is planning-only (no process "
                            f"group), it holds no trained weights.  {_INSTEAD}")
    ref = getattr(pm, "_origin", None)
    model = ref() if ref is not None else None
    routes = getattr(pm, "routes", None)
    if model is None and routes is not None and routes.model is not None:
        # the user's model is gone (auto_parallel(build_model(), ...)): its structure
        # copy, holding fake tensors, gives the class, config and code
        model = routes.model
    if model is None:
        why = ("is gone (nothing else holds it)" if ref is not None else
               "is not known to this module (it was loaded with autopar.load)")
        raise GenerateError(f"pm.generate: the model passed to auto_parallel {why}.  {_INSTEAD}")
    if not callable(getattr(model, "generate", None)):
        raise GenerateError(f"pm.generate: {type(model).__name__}, the model passed to "
                            "auto_parallel, has no generate() method (Hugging Face's "
                            f"GenerationMixin gives one to its generative models).  {_INSTEAD}")
    return model


def versions(pm: ParallelModule) -> tuple[int, ...]:
    """Identity and version of every parameter and buffer ``pm`` holds (see the module
    docstring): equal tuples mean no tensor was written or replaced in between."""
    out: list[int] = []
    for x in (*pm.parameters(), *pm.buffers()):
        out += (id(x), x._version)
        if isinstance(x, DTensor):
            out.append(x._local_tensor._version)
    for e in pm._dparams.entries:  # what the graph reads and the optimizer steps
        out += (e.local._version, -1 if e.host is None else e.host._version)
    return tuple(out)


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on some rank (one all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _working_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``model`` on ``device`` in eval mode, its gradients dropped; the
    user's model is left as it was (its mode included).  Tensors of a structure copy
    (fake tensors) become uninitialized ones, which the gathered state then fills."""
    memo: dict[int, object] = {}
    for t in (*model.parameters(), *model.buffers()):
        if is_fake(t):
            real = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(real, requires_grad=False) if isinstance(t, nn.Parameter) else real
    with building(), torch.no_grad():
        work = copy.deepcopy(model, memo)
    for p in work.parameters():
        p.grad = None
        p.requires_grad_(False)
    return work.to(device).eval()


def _refresh(pm: ParallelModule, model: nn.Module) -> nn.Module:
    """The working copy, gathered again where some rank's tensors changed (collective)."""
    device = pm._mesh_rt.device
    work: Working | None = pm.__dict__.get("_generation")
    now = versions(pm)
    if _any_rank(work is None or work.versions != now, device):
        state = pm.full_state_dict()  # collective: every rank is here
        if work is None:
            work = Working(_working_copy(model, device), now)
        with torch.no_grad():
            work.model.load_state_dict(state)
            # buffers no state dict holds (a structure copy's rotary tables): the module's
            mine = dict(pm.named_buffers())
            for name, b in work.model.named_buffers():
                if name not in state and name in mine:
                    b.copy_(mine[name])
        work.versions = versions(pm)  # gathering may move versions (offload's copies)
        object.__setattr__(pm, "_generation", work)  # not a submodule: not in pm's state
    return work.model


def generate(pm: ParallelModule, *args: Any, **kwargs: Any) -> Any:
    """``generate(*args, **kwargs)`` of the model passed to ``auto_parallel`` with
    ``pm``'s current weights, on this rank's device (see the module docstring).
    Collective: every rank calls it."""
    model = _origin(pm)
    work = _refresh(pm, model)
    # the user's later edits to the model's generation defaults apply, as they would there
    if hasattr(model, "generation_config"):
        work.generation_config = model.generation_config
    device = pm._mesh_rt.device
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))
    with torch.no_grad():
        return work.generate(*args, **kwargs)


__all__ = ["Working", "generate", "versions"]
