"""Optimizer steps over replicated DTensor parameters run on their local tensors.

A ParallelModule's parameters are DTensors (:mod:`autopar.runtime.dparams`), so every
op of ``optimizer.step()`` goes through DTensor's dispatch: AdamW's eight foreach ops
cost ~2.9 ms more per step over a 69-tensor GPT's DTensors than over the same plain
tensors on this repository's CPU host (``benchmarks/optimizer_overhead.py``).  DDP's
parameters are plain tensors and do not pay it.

A parameter replicated on every mesh axis *is* its local tensor: same shape, same
values on every rank, and any optimizer's arithmetic on one is its arithmetic on the
other.  So for an optimizer all of whose parameters are such (data parallelism, on any
mesh), a process-wide step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``) points its parameter groups and state at the local
tensors for the step, and the post-hook points them back, wrapping any state the step
created as a replicated DTensor (what ``zeros_like`` of the DTensor would have made).
Outside ``step()`` the optimizer holds exactly what it held before: DTensor parameters
and DTensor state, so ``state_dict()``, DCP and LR schedulers see no difference.

The hook steps aside (the step runs over DTensors as before) unless every parameter of
every group is a replicated ParallelModule parameter whose ``.grad`` is the DTensor view
of its local gradient the runtime made (a gradient the user replaced, or set on the
DTensor only, is stepped as the user left it), and the optimizer is one of
``torch.optim``'s element-wise classes listed in :data:`KINDS`, whose state is known to
be per-element tensors of the parameter's shape and scalar steps.  A sharded parameter
(tensor parallelism, ZeRO's flat shards) is never swapped: a per-tensor norm or a
factored state of a shard is not the parameter's.

A step that raises skips torch's post-hooks; the next step's pre-hook (of any
optimizer swapped earlier) puts that optimizer back first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

_LOCAL = "_autopar_local"  # on a replicated DTensor parameter: the local tensor it views
_SWAPPED = "_autopar_swapped"  # on an optimizer during its step: what to put back

KINDS: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta})
"""Optimizer classes stepped on local tensors (exactly these, not subclasses: a subclass
may keep state the post-hook would not know how to wrap)."""

enabled = True
"""Process-wide switch (benchmarks and tests compare both paths in one process)."""

_installed = False
steps_local = 0
"""How many steps ran on local tensors (tests check the fast path was taken)."""


@dataclass
class _Swap:
    """What one swapped step changed: each group's original parameter list, and per
    parameter its DTensor, its local tensor, its state before the step and the values
    of the local state handed to the step."""

    groups: list[tuple[dict, list]]
    moved: list[tuple[torch.Tensor, torch.Tensor, dict | None, tuple]]


def mark(param: torch.Tensor, local: torch.Tensor) -> None:
    """Let optimizer steps over ``param`` (a DTensor replicated on every mesh axis)
    run on ``local``, the plain tensor it views; installs the hooks once."""
    global _installed
    setattr(param, _LOCAL, local)
    if not _installed:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        register_optimizer_step_pre_hook(_pre)
        register_optimizer_step_post_hook(_post)
        _installed = True


def _pairs(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(DTensor, local) for every parameter, or None when the step must stay on DTensors."""
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            loc = getattr(p, _LOCAL, None)
            if loc is None:
                return None
            gr = p.grad
            if gr is None:
                if loc.grad is not None:  # zero_grad() not yet mirrored: the DTensor's view rules
                    return None
            elif type(gr) is not DTensor or gr._local_tensor is not loc.grad:
                return None
            out.append((p, loc))
    return out


def _pre(opt: torch.optim.Optimizer, args, kwargs) -> None:
    global steps_local
    prior = opt.__dict__.pop(_SWAPPED, None)
    if prior is not None:  # the last step raised before the post-hook
        _restore(opt, prior)
    if not enabled or type(opt) not in KINDS or opt.defaults.get("differentiable"):
        return
    pairs = _pairs(opt)
    if not pairs:
        return
    groups = [(g, g["params"]) for g in opt.param_groups]
    for g, ps in groups:
        g["params"] = [getattr(p, _LOCAL) for p in ps]
    st = opt.state
    moved = []
    for p, loc in pairs:
        s = st.pop(p, None)
        vals = ()
        if s is not None:
            vals = tuple(v._local_tensor if type(v) is DTensor else v for v in s.values())
            st[loc] = dict(zip(s, vals))
        moved.append((p, loc, s, vals))
    opt.__dict__[_SWAPPED] = _Swap(groups, moved)
    steps_local += 1


def _post(opt: torch.optim.Optimizer, args, kwargs) -> None:
    sw = opt.__dict__.pop(_SWAPPED, None)
    if sw is not None:
        _restore(opt, sw)


def _restore(opt: torch.optim.Optimizer, sw: _Swap) -> None:
    for g, ps in sw.groups:
        g["params"] = ps
    st = opt.state
    for p, loc, before, vals in sw.moved:
        s = st.pop(loc, None)
        if s is None:
            if before is not None:
                st[p] = before
        elif (before is not None and len(s) == len(vals) and s.keys() == before.keys()
              and all(a is b for a, b in zip(s.values(), vals))):
            st[p] = before  # the usual step: every value updated in place
        else:  # the first step (state created), or values replaced
            before = before or {}
            st[p] = {k: _back(v, before.get(k), p) for k, v in s.items()}


def _back(v, old, p: torch.Tensor):
    """A state value as the DTensor step would have left it: the DTensor it was (its
    local tensor updated in place), a new tensor of one or more dimensions wrapped as a
    replicated DTensor on ``p``'s mesh, anything else (scalar steps) as it is."""
    if type(old) is DTensor and old._local_tensor is v:
        return old
    if type(v) is not torch.Tensor or v.dim() == 0:
        return v
    spec = p._spec
    if v.shape == p.shape and v.dtype == p.dtype and v.is_contiguous():
        return DTensor(v, spec, requires_grad=False)
    return DTensor.from_local(v, spec.mesh, spec.placements, run_check=False)


__all__ = ["KINDS", "enabled", "mark", "steps_local"]
