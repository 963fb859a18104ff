"""State of a ParallelModule under the original model's names.

:class:`TensorInfo` records what the original model's tensors were beyond their values
(frozen, buffer, persistent, used by the forward or not).  :class:`StateMixin` gives
:class:`autopar.module.parallel.ParallelModule` the ``state_dict`` /
``load_state_dict`` pair ``torch.distributed.checkpoint`` expects: DTensors with the
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
from autopar.module.habits import check_loaded_state_dict, mark_state_dict
from autopar.plan.placement import parse_placements
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


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # each parameter's optimizer state under its own name: pipeline stages hold different
    # parameters, and torch's default numbering would collide across them (docs/training.md)
    return StateDictOptions(flatten_optimizer_state_dict=True)


class StateMixin:
    """``state_dict`` / ``load_state_dict`` under original names (see module docstring).

    ``state_dict`` is local (ZeRO parameters are their shards); ``load_state_dict`` is
    collective where the loaded DTensors must be redistributed to this plan."""

    def _state_tensor(self, t: str) -> torch.Tensor:
        e = self._entry.get(t)
        if e is not None:
            return e.param
        return self.inner.get_buffer(t)  # a held target without a DTensor entry is a buffer

    def _held_keys(self) -> list[str]:
        """The state keys this rank holds: all of them, or its pipeline stage's (DCP
        assembles the whole model from every stage's ranks)."""
        return [n for n in self.state_keys
                if n in self._extra or self._target_of.get(n) is not None
                and (self._target_of[n] in self._entry or self._mine(self._target_of[n]))]

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The original model's ``state_dict()`` keys; parameters are DTensors (this
        rank's shard, the plan's placements, ZeRO's ``Shard(0)`` included, the
        parameter's own shape), buffers plain tensors, all sharing storage with the
        module.  No collective: one rank alone may call it (a whole-tensor state dict is
        :meth:`full_state_dict`, collective)."""
        if self._dparams is None:
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        out = OrderedDict() if destination is None else destination
        for name in self._held_keys():
            t = self._target_of.get(name)
            x = self._extra[name] if t is None else self._state_tensor(t)
            out[prefix + name] = x if keep_vars else x.detach()
        mark_state_dict(out, self._dparams.mesh)  # whose shards: checked by load_state_dict
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """Load a state dict from :meth:`state_dict` (DTensors, any plan: they are
        redistributed to this plan's placements) or from the original model (whole
        tensors, sharded here).  With ``strict``, missing or unexpected keys raise.  One
        rank's :meth:`state_dict` written with ``torch.save`` and loaded on a rank whose
        shards differ raises :class:`~autopar.errors.ForeignShardError` on every rank
        (:mod:`autopar.module.habits`)."""
        if self._dparams is None:
            self.load_full_state_dict(state_dict)
            return nn.modules.module._IncompatibleKeys([], [])
        check_loaded_state_dict(state_dict, self)  # another rank's shards: every rank raises
        keys = set(self._held_keys())
        missing = sorted(keys - set(state_dict))
        unexpected = sorted(set(state_dict) - keys - set(self._target_of))
        if strict and (missing or unexpected):
            raise AutoparError(f"load_state_dict: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]} (the original model's state_dict keys are expected)")
        wholes: dict[str, tuple[str, torch.Tensor]] = {}
        for name, v in state_dict.items():
            t = self._target_of.get(name)
            if t is None:
                if name in self._extra:
                    x = self._extra[name]
                    with torch.no_grad():
                        (x.to_local() if isinstance(x, DTensor) else x).copy_(
                            v.full_tensor() if isinstance(v, DTensor) else v)
                continue
            if t in wholes:
                continue  # a tied weight's second name
            if isinstance(v, DTensor):
                pl = self._placements.get(t)
                v = v.redistribute(self._dparams.mesh, pl).to_local() if pl is not None else v.full_tensor()
                wholes[t] = ("local", v)
            else:
                wholes[t] = ("full", v)
        self._load_pieces(wholes)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------ checkpoints
    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(model, optimizer) state dicts to save with DCP that load into any plan, on
        any number of ranks: torch's ``get_state_dict(self, optimizer,
        flatten_optimizer_state_dict=True)`` (every parameter's state, ZeRO's included,
        is a DTensor of the parameter's own shape, so DCP reshards it).  To resume, take
        these as the target, ``dcp.load`` into them and pass them to
        :meth:`load_checkpoint_state` (docs/training.md)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self, optimizer, options=_flat_options())

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, model_state: dict,
                              optim_state: dict) -> None:
        """Load what :meth:`checkpoint_state` gave (after ``dcp.load`` filled it) into
        this module and ``optimizer`` (torch's ``set_state_dict``)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=_flat_options())

    def _load_targets(self, full_state: Mapping[str, torch.Tensor], coord) -> None:
        pieces = {}
        for t, _ in self._targets():
            names = self.aliases[t]
            src = next((full_state[n] for n in names if n in full_state), None)
            if src is None:
                raise KeyError(f"state dict has none of {names}")
            pieces[t] = ("full", src)
        self._load_pieces(pieces, coord)
        with torch.no_grad():
            for n, x in self._extra.items():
                if n in full_state:
                    (x.to_local() if hasattr(x, "to_local") else x).copy_(full_state[n])

    def _load_pieces(self, pieces: Mapping[str, tuple[str, torch.Tensor]], coord=None) -> None:
        """Set targets from ``("full", whole tensor)`` (sharded here) or ``("local",
        this rank's tensor in its planned placement)``, in place once the module owns
        its tensors (DTensor parameters and optimizers keep pointing at them)."""
        coord = self._coord() if coord is None else coord
        zt = self.zero.targets() if getattr(self, "zero", None) is not None else set()
        for t, p in self._targets():
            if t not in pieces:
                continue
            kind, src = pieces[t]
            pl = self._placements.get(t, tuple(parse_placements("R" * len(coord))))
            if p is None and t not in zt:
                continue  # held by another pipeline stage
            local = shard_tensor(src.detach(), pl, self.plan.mesh.shape, coord) if kind == "full" \
                else src.detach()
            if t in zt:
                self.zero.load_whole(t, local)
                continue
            with torch.no_grad():
                if p.shape == local.shape and getattr(self, "_owns_params", False):
                    p.copy_(local)
                else:
                    self._replace(t, local.clone(), isinstance(p, nn.Parameter))
        # the captured graph shares tensors with the user's model: from here on this
        # module owns fresh ones, so the user's model is never modified
        self._owns_params = True
        if getattr(self, "_dparams", None) is not None:
            self._dparams.pull()  # offload: the host copies the optimizer steps

    def _replace(self, target: str, tensor: torch.Tensor, is_param: bool) -> None:
        *path, leaf = target.split(".")
        owner = self.inner.get_submodule(".".join(path)) if path else self.inner
        if is_param:
            owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=not self._frozen(target)))
        else:
            owner.register_buffer(leaf, tensor)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an original-model state dict (whole tensors) by sharding it in."""
        self._load_targets(state_dict, self._coord())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict: original names, whole tensors.

        Collective when running: every rank must call it."""
        whole = {}
        for t, p in self._local_wholes():
            pl = self._placements.get(t)
            if pl is None or self._mesh_rt is None:
                whole[t] = p.detach().clone()
            else:
                whole[t] = gather_tensor(p, pl, self._mesh_rt.group)
        out = {}
        for key in self.state_keys:
            t = self._target_of.get(key)
            if t is not None:
                out[key] = whole[t]
            elif key in self._extra:  # never read by the forward: kept whole on every rank
                x = self._extra[key].detach()
                out[key] = (x.to_local() if hasattr(x, "to_local") else x).clone()
        return out

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, keyed by graph target."""
        return {t: p.detach().clone() for t, p in self._local_wholes()}

    def _local_wholes(self, grads: bool = False) -> list[tuple[str, torch.Tensor | None]]:
        """(target, this rank's tensor in its planned placement) for every parameter and
        buffer, or their gradients; collective under ZeRO (gathers shards)."""
        if self._dparams is not None:
            self._dparams.push()  # offload: what the optimizer stepped on the host
        zt = self.zero.targets() if self.zero is not None else set()
        out = []
        for t, p in self._targets():
            if t in zt:
                x = self.zero.local_whole(t, grad=grads)
            elif grads:
                x = p.grad if isinstance(p, nn.Parameter) else None
            else:
                x = p
            if self.plan.decisions.pipeline_stages > 1 and self._mesh_rt is not None:
                x = self._from_owner_stage(t, x, grads)
            out.append((t, x))
        return out

    def _from_owner_stage(self, t: str, x: torch.Tensor | None, grads: bool) -> torch.Tensor | None:
        """Broadcast ``t`` from the pipeline stage that holds it (collective over the
        pipeline axis; every rank walks the targets in the same order)."""
        m = self._mesh_rt
        src = m.stage_rank(self._owner.get(t, 0))
        mine = x is not None and self._mine(t)
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
        out = {}
        for t, g in self._local_wholes(grads=True):
            if g is None or t not in self._placements:
                continue
            whole = gather_tensor(g, self._placements[t], self._mesh_rt.group)
            for n in self.aliases[t]:
                out[n] = whole
        return out


__all__ = ["StateMixin", "TensorInfo"]
