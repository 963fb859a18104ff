"""DDP habits that meet a ParallelModule: the model passed to ``auto_parallel`` and
one rank's state dicts.

DDP trains the model it wraps in place; :func:`autopar.auto_parallel` gives the
ParallelModule parameters of its own (DTensor shards on the plan's mesh), as FSDP2's
``fully_shard`` does.  So the original model keeps the weights it had, and two habits
written for DDP would go silently wrong.  They raise :class:`~autopar.errors.StaleModelError`
instead, naming what to call:

* an optimizer built over ``model.parameters()`` before ``auto_parallel``: at its first
  ``step()``, when it holds replaced parameters that never got a gradient since;
* ``model.state_dict()`` (so Hugging Face's ``model.save_pretrained``) after
  ``auto_parallel``: the trained weights are the module's
  (:func:`save_pretrained` writes them).

And a state dict of this rank's shards written by one rank and loaded by every rank
(the DDP tutorial's ``torch.save`` on rank 0) would give every rank rank 0's pieces of
a sharded tensor.  ``pm.state_dict()`` and an optimizer's ``state_dict()`` record the
rank and mesh coordinate that wrote them (the state dict's ``_metadata``, which
``torch.save`` keeps, and a key of each parameter group, which
``Optimizer.load_state_dict`` keeps); loading them on a rank whose shards differ raises
:class:`~autopar.errors.ForeignShardError` on every rank (the ranks agree first).  A
plan that shards nothing (data parallel) loads them as before: they are right there.

The checks ride on one process-wide optimizer step pre-hook, registered when this
module is imported (before :mod:`autopar.runtime.local_step`'s, which swaps in local
tensors for the step).  An optimizer is looked at once per set of parameter groups
(remembered on the optimizer); every later step costs a tuple of their ids.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import ForeignShardError, StaleModelError

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule

SAVED_BY = "autopar_saved_by"
"""The key, in a state dict's ``_metadata`` and in an optimizer state dict's parameter
groups, of the rank and mesh coordinate whose shards it holds."""

_FIX_MODEL = ("save the trained weights with pm.save_pretrained(directory) (Hugging Face "
              "models; every rank calls it, rank 0 writes) or pm.full_state_dict() (every rank "
              "calls it: whole tensors under the original names), or checkpoint with "
              "autopar.save_checkpoint(pm, optimizer, path)")
_FIX_SHARDS = ("pm.state_dict() and optimizer.state_dict() hold this rank's shards only: "
               "checkpoint with autopar.save_checkpoint(pm, optimizer, path) or "
               "torch.distributed.checkpoint (every rank saves and loads its part), or let "
               "every rank torch.save its own file; for one file of whole tensors, every rank "
               "calls pm.full_state_dict(), rank 0 saves it, and every rank loads it with "
               "pm.load_state_dict(...)")


@dataclass
class _Replaced:
    """A parameter of a model passed to ``auto_parallel``: the parameter (weakly), its
    name and its gradient when it was replaced (weakly; None if it had none)."""

    param: weakref.ref
    name: str
    grad: weakref.ref | None


@dataclass
class _Owned:
    """A parameter of a ParallelModule and the module (both weakly)."""

    param: weakref.ref
    module: weakref.ref


_REPLACED: dict[int, _Replaced] = {}  # id(original parameter) -> record
_OWNED: dict[int, _Owned] = {}  # id(ParallelModule parameter) -> record
_STALE_MODELS: dict[int, weakref.ref] = {}  # id(model) -> model, replaced by a module
_CHECKED = "_autopar_habits_seen"  # optimizer attribute: the parameter groups last looked at
_MARKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose state_dict() is marked
_BUILDING = threading.local()  # autopar reads the model while it builds a module


def _forget(table: dict, key: int):
    def drop(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is ref or getattr(entry, "param", None) is ref:
            del table[key]
    return drop


def shards_state(pm: ParallelModule) -> bool:
    """Whether some rank's state differs from another's under ``pm``'s plan (a sharded
    placement on an axis of more than one rank, or ZeRO): the same answer on every rank,
    so the ranks take part in the same collectives."""
    shape = pm.plan.mesh.shape
    return pm.zero is not None or any(
        not p.is_replicate() and shape[a] > 1 for pl in pm._placements.values() for a, p in enumerate(pl))


@contextmanager
def building():
    """Autopar itself reads the model's ``state_dict()`` while it captures and plans a
    model (also one an earlier ``auto_parallel`` replaced): not the user's habit."""
    depth = getattr(_BUILDING, "depth", 0)
    _BUILDING.depth = depth + 1
    try:
        yield
    finally:
        _BUILDING.depth = depth


def adopt(model: nn.Module, pm: ParallelModule) -> None:
    """Record that ``pm`` replaced ``model``'s parameters (under a process group): the
    checks of the module docstring, and ``pm.save_pretrained``'s model."""
    for name, p in model.named_parameters():
        key = id(p)
        grad = weakref.ref(p.grad) if p.grad is not None else None
        _REPLACED[key] = _Replaced(weakref.ref(p, _forget(_REPLACED, key)), name, grad)
    for p in pm.parameters():
        key = id(p)
        _OWNED[key] = _Owned(weakref.ref(p, _forget(_OWNED, key)), weakref.ref(pm))
    key = id(model)
    if key not in _STALE_MODELS:
        model.register_state_dict_pre_hook(_refuse_state_dict)
    _STALE_MODELS[key] = weakref.ref(model, _forget(_STALE_MODELS, key))
    object.__setattr__(pm, "_origin", weakref.ref(model))


def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """State-dict pre-hook of a replaced model (a plain function: the model still
    deep-copies and pickles; its copies are not refused)."""
    ref = _STALE_MODELS.get(id(module))
    if ref is None or ref() is not module or getattr(_BUILDING, "depth", 0):
        return
    raise StaleModelError(
        f"{type(module).__name__}.state_dict() (also what save_pretrained() calls) after "
        "auto_parallel: the ParallelModule trains parameters of its own, so this model still "
        f"holds the weights it had before auto_parallel.  Instead {_FIX_MODEL}")


# ---------------------------------------------------------------- optimizer steps
def _before_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The process-wide step pre-hook: both checks, once per set of parameter groups."""
    if not _REPLACED and not _OWNED:
        return
    seen = tuple(map(id, opt.param_groups))
    if opt.__dict__.get(_CHECKED) == seen:
        return
    _check_stale(opt)
    owners = {id(m): m for g in opt.param_groups for p in g["params"] if _is(_OWNED, p)
              and (m := _OWNED[id(p)].module()) is not None}
    if owners:
        if opt not in _MARKED:
            opt.register_state_dict_post_hook(_mark_optimizer_state)
            _MARKED.add(opt)
        _check_loaded_optimizer(opt, any(shards_state(m) for m in owners.values()))
    opt.__dict__[_CHECKED] = seen


def _is(table: dict, p: torch.Tensor) -> bool:
    entry = table.get(id(p))
    return entry is not None and entry.param() is p


def _check_stale(opt: torch.optim.Optimizer) -> None:
    """Raise when ``opt`` holds replaced parameters none of which got a gradient since
    (it was built before ``auto_parallel``, and the module trains)."""
    stale = [_REPLACED[id(p)] for g in opt.param_groups for p in g["params"] if _is(_REPLACED, p)]
    if not stale:
        return
    fresh = [r for r in stale if (p := r.param()) is not None and p.grad is not None
             and (r.grad is None or r.grad() is not p.grad)]
    if fresh:
        return  # the user trains the original model itself (a reference, say)
    names = ", ".join(repr(r.name) for r in stale[:3]) + (", ..." if len(stale) > 3 else "")
    raise StaleModelError(
        f"{type(opt).__name__}.step(): this optimizer holds parameters of the model passed to "
        f"auto_parallel ({names}), which the ParallelModule replaced with its own, so the step "
        "would never change the module you train.  Build the optimizer after auto_parallel, "
        "from the module's parameters: pm = auto_parallel(model, ...); "
        f"optimizer = torch.optim.{type(opt).__name__}(pm.parameters(), ...)")


# ---------------------------------------------------------------- one rank's state dicts
def _coord(mesh) -> list[int]:
    return list(mesh.get_coordinate() or ())


def _foreign(value: Any, coord: list[int], mine: list[int]) -> bool:
    """Whether ``value`` (loaded here) is a DTensor sharded (or partial) on a mesh axis
    where ``mine``, this rank's coordinate on the live mesh, differs from ``coord``, the
    writer's.  (An unpickled DTensor's own mesh still gives the writer's coordinate.)"""
    if not isinstance(value, DTensor):
        return False
    mesh = value.device_mesh
    return len(mine) == len(coord) == mesh.ndim and any(
        not p.is_replicate() and mesh.size(a) > 1 and mine[a] != coord[a]
        for a, p in enumerate(value.placements))


def saved_by(mesh) -> dict:
    """The record :data:`SAVED_BY` holds: this process's rank and coordinate on ``mesh``."""
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "coord": _coord(mesh)}


def mark_state_dict(sd: dict, mesh) -> None:
    """Record in ``sd._metadata`` (which ``torch.save`` keeps) whose shards it holds."""
    meta = getattr(sd, "_metadata", None)
    if meta is None:
        meta = OrderedDict()
        sd._metadata = meta
    meta[SAVED_BY] = saved_by(mesh)


def _agree(problem: str | None) -> None:
    """Raise ``problem`` (a rank's :class:`ForeignShardError` text) on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, problem)
        problem = next((m for m in every if m is not None), None)
    if problem is not None:
        raise ForeignShardError(problem)


def check_loaded_state_dict(state_dict: Mapping[str, Any], pm: ParallelModule) -> None:
    """Before ``pm.load_state_dict``: a state dict another rank wrote (its ``_metadata``
    says so) whose shards are not this rank's raises on every rank.  A state dict
    without the record (made in this process, or not by autopar), or a plan whose ranks
    all hold the same state (data parallel), is not looked at: no rank communicates."""
    meta = getattr(state_dict, "_metadata", None)
    rec = meta.get(SAVED_BY) if isinstance(meta, Mapping) else None
    if not isinstance(rec, Mapping) or not shards_state(pm):
        return
    me = dist.get_rank() if dist.is_initialized() else 0
    coord, mine = list(rec.get("coord", [])), _coord(pm._dparams.mesh)
    bad = [k for k, v in state_dict.items() if _foreign(v, coord, mine)]
    problem = None
    if bad and rec.get("rank") != me:
        problem = (f"load_state_dict: this state dict was written by rank {rec.get('rank')} (mesh "
                   f"coordinate {tuple(rec.get('coord', []))}) and holds its shards of "
                   f"{len(bad)} sharded tensors ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), "
                   f"which rank {me} would load as its own.  {_FIX_SHARDS}")
    _agree(problem)


def _mark_optimizer_state(opt: torch.optim.Optimizer, sd: dict) -> dict:
    """State-dict post-hook of an optimizer over a ParallelModule's parameters: each
    parameter group records the writer and the sums of its sharded state's local
    tensors, which tell its shards from the ones DCP reshards into a loading rank."""
    for group in sd["param_groups"]:
        mesh = None
        for i in group["params"]:
            for v in sd["state"].get(i, {}).values():
                if isinstance(v, DTensor):
                    mesh = v.device_mesh
        if mesh is not None:
            group[SAVED_BY] = saved_by(mesh) | {"sums": _sums(sd["state"], group["params"])}
    return sd


def _sums(state: Mapping, keys: list) -> list[float]:
    """The float64 sum of every sharded DTensor state value's local tensor, in order."""
    out = []
    for k in keys:
        for name in sorted(state.get(k, {})):
            v = state[k][name]
            if isinstance(v, DTensor) and any(not p.is_replicate() for p in v.placements):
                out.append(float(v._local_tensor.double().sum()))
    return out


def _check_loaded_optimizer(opt: torch.optim.Optimizer, sharded_plan: bool) -> None:
    """At the first step after ``opt.load_state_dict``: state another rank wrote with
    ``torch.save`` (its groups' record names another coordinate on an axis its state is
    sharded on, and the state's sums are the writer's) raises on every rank.  Under a
    plan whose ranks all hold the same state (``sharded_plan`` false) no rank communicates."""
    groups = [g for g in opt.param_groups if SAVED_BY in g]
    if not groups or not sharded_plan:
        for g in groups:  # every rank holds the same state: right on any rank
            g.pop(SAVED_BY, None)
        return
    me, problem = dist.get_rank() if dist.is_initialized() else 0, None
    for g in groups:
        rec = g[SAVED_BY]
        coord = list(rec.get("coord", []))
        sharded = any(_foreign(v, coord, _coord(p.device_mesh)) for p in g["params"]
                      if isinstance(p, DTensor) for v in opt.state.get(p, {}).values())
        sums = _sums(opt.state, g["params"])
        # all-zero state (never stepped) is the same on every rank: nothing to tell apart
        if sharded and rec.get("rank") != me and any(sums) and rec.get("sums") == sums:
            problem = (f"{type(opt).__name__}.step() after load_state_dict: the optimizer state was "
                       f"written by rank {rec.get('rank')} (mesh coordinate {tuple(coord)}) and "
                       f"holds its shards, which rank {me} loaded as its own.  {_FIX_SHARDS}")
            break
    _agree(problem)
    for g in groups:
        g.pop(SAVED_BY, None)


# ---------------------------------------------------------------- Hugging Face
def save_pretrained(pm: ParallelModule, directory, **kwargs) -> None:
    """The trained weights through the original model's ``save_pretrained``: every
    rank gathers the whole state (collective), rank 0 writes it."""
    ref = getattr(pm, "_origin", None)
    model = ref() if ref is not None else None
    if model is None or not hasattr(model, "save_pretrained"):
        raise StaleModelError(
            "pm.save_pretrained needs the Hugging Face model passed to auto_parallel (its config "
            f"and class), and {'it is gone' if ref is not None else 'there is none'}; save "
            "pm.full_state_dict() (every rank calls it) with model.save_pretrained(directory, "
            "state_dict=...) on rank 0 instead")
    state = pm.full_state_dict()
    if not dist.is_initialized() or dist.get_rank() == 0:
        with building():
            model.save_pretrained(directory, state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()  # the files exist on every rank's return


register_optimizer_step_pre_hook(_before_step)

__all__ = ["SAVED_BY", "adopt", "building", "check_loaded_state_dict", "mark_state_dict",
           "save_pretrained", "saved_by", "shards_state"]
