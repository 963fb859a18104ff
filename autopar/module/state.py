"""State of a ParallelModule under the original model's names.

:class:`TensorInfo` records what the original model's tensors were beyond their values
(frozen, buffer, persistent, used by the forward or not).  :class:`StateMixin` gives
:class:`autopar.module.parallel.ParallelModule` the ``state_dict`` /
``load_state_dict`` pair ``torch.distributed.checkpoint`` expects: DTensors with the
plan's placements, in the parameters' own shapes, under the original names, so a
checkpoint saved under one plan loads exactly into another (DCP reshards) or into the
plain model in one process.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError


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


class StateMixin:
    """``state_dict`` / ``load_state_dict`` under original names (see module docstring).

    Both are collective under a ZeRO stage-3 plan (the parameter is gathered from its
    shards) and with stages 1-2 (shards updated by the optimizer are gathered first)."""

    def _state_tensor(self, t: str) -> torch.Tensor:
        e = self._entry.get(t)
        if self.zero is not None and t in self.zero.targets():
            from autopar.runtime.dparams import as_dtensor
            zp = self.zero._by_target[t]
            whole = zp.full.detach() if zp.full is not None else self.zero.local_whole(t)
            pl = self._placements[t]
            return as_dtensor(whole, self._dparams.mesh, pl, tuple(self._param_nodes[t].shape[0]))
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
        rank's shard, the plan's placements, the parameter's own shape), buffers plain
        tensors.  The tensors share storage with the module except ZeRO-3 parameters,
        which are gathered copies: load them back with :meth:`load_state_dict`."""
        if self._dparams is None:
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        if self.zero is not None:
            self.zero.refresh()
        out = OrderedDict() if destination is None else destination
        for name in self._held_keys():
            t = self._target_of.get(name)
            x = self._extra[name] if t is None else self._state_tensor(t)
            out[prefix + name] = x if keep_vars else x.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """Load a state dict from :meth:`state_dict` (DTensors, any plan: they are
        redistributed to this plan's placements) or from the original model (whole
        tensors, sharded here).  With ``strict``, missing or unexpected keys raise."""
        if self._dparams is None:
            self.load_full_state_dict(state_dict)
            return nn.modules.module._IncompatibleKeys([], [])
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


__all__ = ["StateMixin", "TensorInfo"]
