"""``copy.deepcopy`` of a ParallelModule: an independent module that works.

A field-by-field deep copy would copy the DTensor parameters and the generated graph's
local tensors apart (each parameter is a view of a local tensor the graph reads), and
copy the runtime's hooks and buckets pointing at the original's tensors: the copy's
forward would read tensors no parameter updates, so an EMA kept by
``torch.optim.swa_utils.AveragedModel(pm)`` would return the untrained model's loss.

:func:`clone_module` instead builds the copy the way :func:`autopar.load` builds a
module from an export, in memory and without collectives: this rank's tensors under
the lowered graph (the graph before the runtime's rewrites), then a fresh
ParallelModule applies the plan's runtime decisions to it (ZeRO, recomputation, the
pipeline split, gradient buckets, DTensor parameters), and every parameter and buffer
takes the original's current values.  The copy shares the plan and the mesh's process
groups with the original, nothing else: updating one's parameters leaves the other's
output as it was.  The copy runs eagerly (:meth:`ParallelModule.compile` it again).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from autopar.module.export import _constants, attach, snapshot
from autopar.module.load import _stand_ins
from autopar.plans.placement import local_shape
from autopar.runtime.mesh import activate

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule


def _local(x: torch.Tensor) -> torch.Tensor:
    return x._local_tensor if isinstance(x, DTensor) else x


def _tensors(pm: ParallelModule) -> dict[str, tuple[torch.Tensor, bool]]:
    """Graph target -> (this rank's tensor in its planned placement, is parameter), for
    the lowered graph: copies of the module's, zeros for ZeRO-3 parameters (which exist
    only as shards: their values are copied after the copy shards them), meta stand-ins
    for other pipeline stages'."""
    p = pm._parts
    params = set(p.placements)
    out: dict[str, tuple[torch.Tensor, bool]] = {}
    for t, x in p.targets():
        if x is not None:
            out[t] = (x.detach().clone(), t in params)
        elif p.mine(t) and t in p.entry:
            node, e = pm._param_nodes[t], p.entry[t]
            shape = local_shape(tuple(node.shape[0]), p.placements[t], p.plan.mesh.shape)
            out[t] = (torch.zeros(shape, dtype=e.param.dtype, device=p.mesh.device), True)
    owner = {t: s for t, s in p.owner.items() if not p.mine(t)}
    return out | _stand_ins(pm.plan, out, owner, params)


def clone_module(pm: ParallelModule, memo: dict) -> ParallelModule:
    """An independent copy of ``pm`` (see the module docstring); a planning-only
    module is deep-copied field by field (it holds no runtime)."""
    cls = type(pm)
    if pm._mesh_rt is None:
        new = cls.__new__(cls)
        memo[id(pm)] = new
        new.__dict__.update(copy.deepcopy(pm.__dict__, memo))
        return new
    activate(pm._mesh_rt)  # the copy's runtime is built on the original's groups
    graph = snapshot(pm.lowered_graph)
    root = nn.Module()
    for name, (tensor, is_param) in (_tensors(pm) | _constants(pm, graph)).items():
        attach(root, name, tensor, is_param)
    extra = {n: _local(x).detach().clone() for n, x in pm._extra.items()}
    new = cls(fx.GraphModule(root, graph), pm.plan, pm.aliases, pm._in_spec, pm._out_spec,
              list(pm.state_keys), None, runtime=True, info=pm.info,
              binder=copy.deepcopy(dataclasses.replace(pm.binder, select=None)), batch=pm.binder.mode, extra=extra)
    memo[id(pm)] = new
    if "_origin" in pm.__dict__:  # the model passed to auto_parallel: save_pretrained, generate
        object.__setattr__(new, "_origin", pm._origin)
    # other shapes: the copy lowers them on its own parameters, from the same structure copy
    new.routes = copy.deepcopy(pm.routes)
    new._route = new.routes.planned
    _copy_values(pm, new)
    new.train(pm.training)
    if pm.rng is not None:
        new.rng = torch.Generator(device=pm.rng.device)
        new.rng.set_state(pm.rng.get_state())
    return new


def _copy_values(src: nn.Module, dst: nn.Module) -> None:
    """Every parameter and buffer of ``dst`` takes ``src``'s value (local tensors: the
    two modules run the same plan, so their shards line up)."""
    mine = dict(src.named_parameters()) | dict(src.named_buffers())
    with torch.no_grad():
        for name, x in [*dst.named_parameters(), *dst.named_buffers()]:
            _local(x).copy_(_local(mine[name]))


__all__ = ["clone_module"]
