"""Optimizer steps over DTensor parameters run on their local tensors.

A ParallelModule's parameters are DTensors (:mod:`autopar.runtime.dparams`), so every
op of ``optimizer.step()`` goes through DTensor's dispatch: AdamW's eight foreach ops
cost ~2.9 ms more per step over a 69-tensor GPT's DTensors than over the same plain
tensors on this repository's CPU host (``benchmarks/optimizer_overhead.py``).  DDP's
parameters are plain tensors and do not pay it.

The optimizers of :data:`KINDS` are element-wise: each element of a parameter is
updated from the same element of its gradient and state, and from scalars (the step
count, the learning rate).  A DTensor's local tensor is this rank's elements of it
(all of them when replicated, its shard under tensor parallelism or ZeRO), and the
runtime's gradient has the parameter's placements (:mod:`autopar.runtime.dparams`), so
its local tensor holds this rank's elements of the gradient.  Stepping the local
tensors is therefore the DTensor step, element for element: DTensor runs the same ops
on the same local tensors (no op of these steps needs a collective).  So a
process-wide step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
points the parameter groups and state at the local tensors for the step, and the
post-hook points them back, wrapping any state the step created as a DTensor with the
parameter's spec (what ``zeros_like`` of the DTensor would have made).  Outside
``step()`` the optimizer holds exactly what it held before: DTensor parameters and
DTensor state, so ``state_dict()``, DCP and LR schedulers see no difference.

The hook steps aside (the step runs over DTensors as before) unless every parameter of
every group is a ParallelModule parameter whose ``.grad`` is the DTensor view of its
local gradient the runtime made, with the parameter's placements (a gradient the user
replaced, or set on the DTensor only, is stepped as the user left it), and the
optimizer is one of ``torch.optim``'s element-wise classes listed in :data:`KINDS`,
whose state is known to be per-element tensors of the parameter's shape and scalar
steps.  Optimizers with a per-tensor norm or factored state (LAMB, Adafactor) are not
listed: on a shard those would differ from the parameter's.

Nothing but the optimizer's own step body sees the local tensors: the step stays on
DTensors when a closure is passed (it may replace a gradient after the pre-hook
looked), when the optimizer has step hooks of its own or another process-wide step
hook is registered (torch runs those between ours and the step), and while
``torch.compile`` traces.  State keeps its order (``state_dict()`` packs it in order).

A step that raises skips torch's post-hooks: the optimizer is put back by its next
step, ``state_dict()`` or ``load_state_dict()`` (hooks registered at its first swap);
until then its groups show the local tensors.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as O
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# id(DTensor parameter) -> (a weak reference to it, the local tensor it
# views).  Not an attribute on the parameter: deepcopy and pickle copy a tensor's
# attributes, and a copied parameter would then step a copy of the local tensor.
_REG: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_SWAPPED = "_autopar_swapped"  # on an optimizer during its step: what to put back
_GUARDED = "_autopar_guarded"  # on an optimizer: its state_dict hooks put a raised step back
_SCALARS = frozenset({"step", "mu_product"})
"""State keys :data:`KINDS` keep as plain scalar tensors (the others are shaped like the
parameter, DTensors on the DTensor path, also for a 0-dim parameter)."""

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
    local tensor (by id) its DTensor parameter, that parameter's state before the step
    (None if it had none) and the values of the local state handed to the step."""

    groups: list[tuple[dict, list]]
    by_local: dict[int, tuple[torch.Tensor, dict | None, tuple]]


def mark(param: torch.Tensor, local: torch.Tensor) -> None:
    """Let optimizer steps over ``param`` (a DTensor parameter of a ParallelModule) run
    on ``local``, the plain tensor it views; installs the hooks once."""
    global _installed
    key = id(param)
    _REG[key] = (weakref.ref(param, lambda _r, k=key: _REG.pop(k, None)), local)
    if not _installed:
        register_optimizer_step_pre_hook(_pre)
        register_optimizer_step_post_hook(_put_back)
        _installed = True


def _pairs(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(DTensor, local) for every parameter, or None when the step must stay on DTensors."""
    out = []
    reg = _REG
    for g in opt.param_groups:
        for p in g["params"]:
            entry = reg.get(id(p))
            if entry is None or entry[0]() is not p:
                return None
            loc = entry[1]
            gr = p.grad
            if gr is None:
                if loc.grad is not None:  # zero_grad() not yet mirrored: the DTensor's view rules
                    return None
            elif type(gr) is not DTensor or gr._local_tensor is not loc.grad \
                    or gr._spec.placements != p._spec.placements:
                return None
            out.append((p, loc))
    return out


def _alone(opt: torch.optim.Optimizer, args, kwargs) -> bool:
    """Whether only the optimizer's own step body runs between our hooks: no closure,
    no step hooks of its own, no other process-wide step hook, not traced."""
    if kwargs.get("closure") is not None or len(args) > 1 and args[1] is not None:
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    pre = getattr(O, "_global_optimizer_pre_hooks", None)
    post = getattr(O, "_global_optimizer_post_hooks", None)
    if pre is None or post is None:
        return False
    # autopar's own (runtime/zero.py counts steps) know of the swap; anyone else's may not
    if any(not getattr(h, "__module__", "").startswith("autopar.")
           for h in (*pre.values(), *post.values())):
        return False
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return not (compiling is not None and compiling())


def _pre(opt: torch.optim.Optimizer, args, kwargs) -> None:
    global steps_local
    _put_back(opt)  # the last step raised before the post-hook
    if not enabled or type(opt) not in KINDS or opt.defaults.get("differentiable") \
            or not _alone(opt, args, kwargs):
        return
    pairs = _pairs(opt)
    if not pairs:
        return
    _guard(opt)
    local = dict(pairs)
    groups = [(g, g["params"]) for g in opt.param_groups]
    for g, ps in groups:
        g["params"] = [local[p] for p in ps]
    # the same dict, refilled in its order with the local tensors as keys
    st = opt.state
    items = list(st.items())
    st.clear()
    by_local = {id(loc): (p, None, ()) for p, loc in pairs}
    for p, s in items:
        loc = local.get(p)
        if loc is None:  # state of a tensor no longer in the groups: as it is
            st[p] = s
            continue
        vals = tuple(v._local_tensor if type(v) is DTensor else v for v in s.values())
        st[loc] = dict(zip(s, vals))
        by_local[id(loc)] = (p, s, vals)
    opt.__dict__[_SWAPPED] = _Swap(groups, by_local)
    steps_local += 1


def _put_back(opt: torch.optim.Optimizer, *_args) -> None:
    """Undo a swap still in place (the post-hook, and the guards of a raised step)."""
    sw = opt.__dict__.pop(_SWAPPED, None)
    if sw is not None:
        _restore(opt, sw)


def _guard(opt: torch.optim.Optimizer) -> None:
    """Let ``opt.state_dict()`` and ``opt.load_state_dict()`` put back a step that
    raised (once per optimizer; torch >= 2.2 has these hooks)."""
    if opt.__dict__.get(_GUARDED):
        return
    opt.__dict__[_GUARDED] = True
    for name in ("register_state_dict_pre_hook", "register_load_state_dict_pre_hook"):
        reg = getattr(opt, name, None)
        if reg is not None:
            reg(_put_back)


def _restore(opt: torch.optim.Optimizer, sw: _Swap) -> None:
    for g, ps in sw.groups:
        g["params"] = ps
    st = opt.state
    items = list(st.items())
    st.clear()
    for k, s in items:  # in the step's order: new state after the old, as on DTensors
        entry = sw.by_local.get(id(k))
        if entry is None:
            st[k] = s
            continue
        p, before, vals = entry
        if (before is not None and len(s) == len(vals) and s.keys() == before.keys()
                and all(a is b for a, b in zip(s.values(), vals))):
            st[p] = before  # the usual step: every value updated in place
        else:  # the first step (state created), or values replaced
            before = before or {}
            st[p] = {name: _back(name, v, before.get(name), p) for name, v in s.items()}


def _back(name: str, v, old, p: torch.Tensor):
    """A state value as the DTensor step would have left it: the DTensor it was (its
    local tensor updated in place), a new tensor wrapped as a DTensor with ``p``'s mesh,
    placements and global shape, the scalar steps of :data:`_SCALARS` and non-tensors
    as they are."""
    if type(old) is DTensor and old._local_tensor is v:
        return old
    if type(v) is not torch.Tensor or name in _SCALARS:
        return v
    spec = p._spec
    if v.shape == p._local_tensor.shape and v.dtype == p.dtype and v.is_contiguous():
        return DTensor(v, spec, requires_grad=False)
    return DTensor.from_local(v, spec.mesh, spec.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


__all__ = ["KINDS", "enabled", "mark", "steps_local"]
