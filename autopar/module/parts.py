"""What a ParallelModule is made of, in one place: :class:`Parts` holds the plan, the
generated graph and the runtime pieces the plan's steps install (:mod:`autopar.module.apply`).
The module, its state (:class:`~autopar.module.state.ModuleState`) and its loop habits
(:class:`~autopar.module.loop.LoopHabits`) all read the same :class:`Parts`, so a piece
installed or replaced after construction (ZeRO, the pipeline runner, the multi-copy
graph) is seen by each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.plans.data import Plan
from autopar.plans.placement import replicated_axes

if TYPE_CHECKING:
    from autopar.module.shapes import ShapeRoutes
    from autopar.module.state import TensorInfo
    from autopar.runtime.dparams import DParams, Entry
    from autopar.runtime.inputs import InputBinder
    from autopar.runtime.mesh import RuntimeMesh
    from autopar.runtime.pipeline import PipelineRunner
    from autopar.runtime.zero import Zero


@dataclass(eq=False)
class Parts:
    """A ParallelModule's plan, graph and runtime pieces (graph targets throughout).

    Not an ``nn.Module``: holding ``inner`` here registers nothing on the module, whose
    parameters stay the DTensors under the original names."""

    plan: Plan
    aliases: dict[str, list[str]]
    """Target -> the original model's names for it (tied weights: several)."""
    state_keys: list[str]
    """The original model's ``state_dict()`` keys, in its order."""
    info: TensorInfo
    inner: nn.Module
    """The generated graph (replaced by the multi-copy one under ``copies``)."""
    placements: dict[str, tuple]
    """Parameter -> the plan's placements."""
    owner: dict[str, int]
    """Target -> the pipeline stage holding it (0 without a pipeline)."""
    mesh: RuntimeMesh | None = None
    """This rank's mesh; ``None`` on a planning-only module."""
    zero: Zero | None = None
    dparams: DParams | None = None
    entry: dict[str, Entry] = field(default_factory=dict)
    """Target -> its DTensor parameter's entry."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """The tensors the forward never reads, by original name."""
    runner: PipelineRunner | None = None
    binder: InputBinder | None = None
    routes: ShapeRoutes | None = None

    def coord(self) -> tuple[int, ...]:
        """This rank's coordinate on the plan's mesh (zeros when planning only)."""
        return self.mesh.coord if self.mesh is not None else (0,) * len(self.plan.mesh.shape)

    def replicated_axes(self, t: str) -> tuple[int, ...]:
        """The mesh axes of more than one device that parameter ``t`` is replicated on."""
        pl = self.placements[t]
        return replicated_axes(pl, self.plan.mesh.shape)

    def mine(self, t: str) -> bool:
        """True when this rank's pipeline stage holds target ``t``."""
        stage = self.mesh.stage if self.mesh is not None else 0
        return self.owner.get(t, 0) == stage

    def frozen(self, t: str) -> bool:
        """True when every original name of ``t`` was a frozen parameter."""
        return all(n in self.info.frozen for n in self.aliases.get(t, [t]))

    def targets(self) -> list[tuple[str, torch.Tensor | None]]:
        """(graph target, tensor attribute) for every parameter and buffer; ``None`` for
        a stage-3 ZeRO parameter, which exists only as a shard."""
        out: list[tuple[str, torch.Tensor | None]] = []
        for t in self.aliases:
            try:
                out.append((t, self.inner.get_parameter(t)))
            except AttributeError:
                try:
                    out.append((t, self.inner.get_buffer(t)))
                except AttributeError:
                    out.append((t, None))
        return out


class Part:
    """A ParallelModule attribute kept in its :class:`Parts` (``module._parts``), so
    ``pm.zero``, ``pm.runner``, ... and the helpers reading :class:`Parts` never
    disagree.  ``nn.Module.__setattr__`` registers a module value as a submodule
    instead of setting the attribute: set ``inner`` with ``object.__setattr__``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(_parts(obj), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(_parts(obj), self.name, value)


def _parts(obj: Any) -> Parts:
    parts = obj.__dict__.get("_parts")
    if parts is None:  # AttributeError, so that hasattr() and getattr(..., default) work
        raise AttributeError(f"{type(obj).__name__} has no parts yet")
    return parts


__all__ = ["Part", "Parts"]
