"""State of a ParallelModule under the original model's names.

:class:`TensorInfo` records what the original model's tensors were beyond their values
(frozen, buffer, persistent, used by the forward or not).  :class:`ModuleState` is the
state of :class:`autopar.module.parallel.ParallelModule` (which delegates to it): the
``state_dict`` / ``load_state_dict`` pair ``torch.distributed.checkpoint`` expects: DTensors with the
plan's placements (ZeRO's ``Shard(0)`` included), in the parameters' own shapes, under
the original names, so a checkpoint saved under one plan loads exactly into another
(DCP reshards) or into the plain model in one process.  ``state_dict`` issues no
collective, as FSDP2's does not; gathering whole tensors is explicit and collective
(``full_state_dict``, ``full_grads``; ``load_full_state_dict`` shards them in).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError
from autopar.module.habits import mark_state_dict
from autopar.module.parts import Parts
from autopar.plans.placement import parse_placements
from autopar.runtime.shards import gather_tensor, shard_tensor


@dataclass(frozen=True)
class TensorInfo:
    """The original model's parameters and buffers, beyond their values.

    ``frozen``: parameters with ``requires_grad=False``; ``buffers``: names that are
    buffers; ``nonpersistent``: buffers absent from ``state_dict()``; ``unused``: names
    the forward never reads (kept, replicated, so every state dict still has them)."""

    frozen: frozenset[str] = frozenset()
    buffers: frozenset[str] = frozenset()
    nonpersistent: frozenset[str] = frozenset()
    unused: frozenset[str] = frozenset()

    @classmethod
    def of(cls, model: nn.Module, used: set[str]) -> TensorInfo:
        """Read ``model``; ``used`` holds every name the captured graph reads."""
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        persistent = set(model.state_dict().keys())
        return cls(frozenset(n for n, p in params.items() if not p.requires_grad),
                   frozenset(buffers), frozenset(n for n in buffers if n not in persistent),
                   frozenset(n for n in {**params, **buffers} if n not in used))

    def to_json(self) -> dict:
        """A JSON-ready dict (sorted lists)."""
        return {k: sorted(v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: Mapping | None) -> TensorInfo:
        """Inverse of :meth:`to_json` (``None``: nothing known)."""
        return cls(**{k: frozenset(v) for k, v in (d or {}).items()})


def flat_options():
    # start-up: torch.distributed.checkpoint costs ~0.15 s to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # each parameter's optimizer state under its own name: pipeline stages hold different
    # parameters, and torch's default numbering would collide across them (docs/training.md)
    return StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """torch's ``get_state_dict(module, optimizer)`` with each parameter's optimizer
    state under its own name (:func:`flat_options`)."""
    # start-up: torch.distributed.checkpoint costs ~0.15 s to import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(module, optimizer, options=flat_options())


def load_checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                          optim_state: dict) -> None:
    """torch's ``set_state_dict`` of what :func:`checkpoint_state` gave."""
    # start-up: torch.distributed.checkpoint costs ~0.15 s to import
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=flat_options())




class ModuleState:
    """The state of a ParallelModule under original names (see the module docstring),
    read from its :class:`~autopar.module.parts.Parts`.

    :meth:`state_dict` is local (ZeRO parameters are their shards); :meth:`load_state_dict`
    is collective where the loaded DTensors must be redistributed to this plan."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.target_of = {n: t for t, names in parts.aliases.items() for n in names}
        """Original name -> graph target."""
        self.owns_params = False
        """Whether the module's tensors are its own yet (at first they are the captured
        model's, which must not be written)."""

    def _state_tensor(self, t: str) -> torch.Tensor:
        e = self.parts.entry.get(t)
        if e is not None:
            return e.param
        return self.parts.inner.get_buffer(t)  # a held target without a DTensor entry is a buffer

    def held_keys(self) -> list[str]:
        """The state keys this rank holds: all of them, or its pipeline stage's (DCP
        assembles the whole model from every stage's ranks)."""
        p = self.parts
        return [n for n in p.state_keys
                if n in p.extra or self.target_of.get(n) is not None
                and (self.target_of[n] in p.entry or p.mine(self.target_of[n]))]

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The running module's state dict (ParallelModule.state_dict)."""
        out = OrderedDict() if destination is None else destination
        for name in self.held_keys():
            t = self.target_of.get(name)
            x = self.parts.extra[name] if t is None else self._state_tensor(t)
            out[prefix + name] = x if keep_vars else x.detach()
        mark_state_dict(out, self.parts.dparams.mesh)  # whose shards: checked by load_state_dict
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
        """Load into the running module (ParallelModule.load_state_dict, after its
        foreign-shards check): returns (missing, unexpected) keys."""
        p = self.parts
        keys = set(self.held_keys())
        missing = sorted(keys - set(state_dict))
        unexpected = sorted(set(state_dict) - keys - set(self.target_of))
        if strict and (missing or unexpected):
            raise AutoparError(f"load_state_dict: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]} (the original model's state_dict keys are expected)")
        wholes: dict[str, tuple[str, torch.Tensor]] = {}
        for name, v in state_dict.items():
            t = self.target_of.get(name)
            if t is None:
                if name in p.extra:
                    x = p.extra[name]
                    with torch.no_grad():
                        (x.to_local() if isinstance(x, DTensor) else x).copy_(
                            v.full_tensor() if isinstance(v, DTensor) else v)
                continue
            if t in wholes:
                continue  # a tied weight's second name
            if isinstance(v, DTensor):
                pl = p.placements.get(t)
                v = v.redistribute(p.dparams.mesh, pl).to_local() if pl is not None else v.full_tensor()
                wholes[t] = ("local", v)
            else:
                wholes[t] = ("full", v)
        self.load_pieces(wholes)
        return missing, unexpected

    def load_targets(self, full_state: Mapping[str, torch.Tensor], coord=None) -> None:
        """Load an original-model state dict (whole tensors) by sharding it in, for the
        rank at ``coord`` (this one's by default)."""
        pieces = {}
        for t, _ in self.parts.targets():
            names = self.parts.aliases[t]
            src = next((full_state[n] for n in names if n in full_state), None)
            if src is None:
                raise KeyError(f"state dict has none of {names}")
            pieces[t] = ("full", src)
        self.load_pieces(pieces, coord)
        with torch.no_grad():
            for n, x in self.parts.extra.items():
                if n in full_state:
                    (x.to_local() if hasattr(x, "to_local") else x).copy_(full_state[n])

    def load_pieces(self, pieces: Mapping[str, tuple[str, torch.Tensor]], coord=None) -> None:
        """Set targets from ``("full", whole tensor)`` (sharded here) or ``("local",
        this rank's tensor in its planned placement)``, in place once the module owns
        its tensors (DTensor parameters and optimizers keep pointing at them)."""
        p = self.parts
        coord = p.coord() if coord is None else coord
        zt = p.zero.targets() if p.zero is not None else set()
        for t, x in p.targets():
            if t not in pieces:
                continue
            kind, src = pieces[t]
            pl = p.placements.get(t, tuple(parse_placements("R" * len(coord))))
            if x is None and t not in zt:
                continue  # held by another pipeline stage
            local = shard_tensor(src.detach(), pl, p.plan.mesh.shape, coord) if kind == "full" \
                else src.detach()
            if t in zt:
                p.zero.load_whole(t, local)
                continue
            with torch.no_grad():
                if x.shape == local.shape and self.owns_params:
                    x.copy_(local)
                else:
                    self._replace(t, local.clone(), isinstance(x, nn.Parameter))
        # the captured graph shares tensors with the user's model: from here on this
        # module owns fresh ones, so the user's model is never modified
        self.owns_params = True
        if p.dparams is not None:
            p.dparams.pull()  # offload: the host copies the optimizer steps

    def _replace(self, target: str, tensor: torch.Tensor, is_param: bool) -> None:
        *path, leaf = target.split(".")
        inner = self.parts.inner
        owner = inner.get_submodule(".".join(path)) if path else inner
        if is_param:
            owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=not self.parts.frozen(target)))
        else:
            owner.register_buffer(leaf, tensor)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict: original names, whole tensors (collective
        when running)."""
        p = self.parts
        whole = {}
        for t, x in self.local_wholes():
            pl = p.placements.get(t)
            if pl is None or p.mesh is None:
                whole[t] = x.detach().clone()
            else:
                whole[t] = gather_tensor(x, pl, p.mesh.group)
        out = {}
        for key in p.state_keys:
            t = self.target_of.get(key)
            if t is not None:
                out[key] = whole[t]
            elif key in p.extra:  # never read by the forward: kept whole on every rank
                x = p.extra[key].detach()
                out[key] = (x.to_local() if hasattr(x, "to_local") else x).clone()
        return out

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, keyed by graph target."""
        return {t: x.detach().clone() for t, x in self.local_wholes()}

    def local_wholes(self, grads: bool = False) -> list[tuple[str, torch.Tensor | None]]:
        """(target, this rank's tensor in its planned placement) for every parameter and
        buffer, or their gradients; collective under ZeRO (gathers shards)."""
        p = self.parts
        if p.dparams is not None:
            p.dparams.push()  # offload: what the optimizer stepped on the host
        zt = p.zero.targets() if p.zero is not None else set()
        out = []
        for t, param in p.targets():
            if t in zt:
                x = p.zero.local_whole(t, grad=grads)
            elif grads:
                x = param.grad if isinstance(param, nn.Parameter) else None
            else:
                x = param
            if p.plan.decisions.pipeline_stages > 1 and p.mesh is not None:
                x = self._from_owner_stage(t, x, grads)
            out.append((t, x))
        return out

    def _from_owner_stage(self, t: str, x: torch.Tensor | None, grads: bool) -> torch.Tensor | None:
        """Broadcast ``t`` from the pipeline stage that holds it (collective over the
        pipeline axis; every rank walks the targets in the same order)."""
        m = self.parts.mesh
        src = m.stage_rank(self.parts.owner.get(t, 0))
        mine = x is not None and self.parts.mine(t)
        # shape and dtype travel with the tensor: buffers the plan has no node for (a
        # non-persistent rotary table) and integer buffers are broadcast too
        meta = [(tuple(x.shape), x.dtype) if mine else None]
        dist.broadcast_object_list(meta, src=src, group=m.device_mesh.get_group(0))
        if meta[0] is None:
            return None
        shape, dtype = meta[0]
        x = x.detach().contiguous().clone() if mine else torch.empty(shape, dtype=dtype, device=m.device)
        dist.broadcast(x, src=src, group=m.device_mesh.get_group(0))
        return x

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient under its original names (collective)."""
        p = self.parts
        out = {}
        for t, g in self.local_wholes(grads=True):
            if g is None or t not in p.placements:
                continue
            whole = gather_tensor(g, p.placements[t], p.mesh.group)
            for n in p.aliases[t]:
                out[n] = whole
        return out


__all__ = ["ModuleState", "TensorInfo", "checkpoint_state", "flat_options", "load_checkpoint_state"]
