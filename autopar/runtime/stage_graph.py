"""What the pipeline runner runs on a rank: one pipeline stage of the lowered graph, as
:func:`autopar.passes.split_stages.split_stages` cuts it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx


@dataclass
class StageGraph:
    """One pipeline stage of the lowered graph (:mod:`autopar.passes.split_stages` says how it is cut).

    ``input_shapes[j]`` is the captured (micro-batch, global) shape of model input
    ``inputs[j]`` (None for non-tensors); the runner uses it to tell batch inputs,
    which it splits into micro-batches, from inputs it passes whole.
    """

    stage: int
    num_stages: int
    module: fx.GraphModule
    inputs: list[int]
    recv: list[str]
    send: list[str]
    num_outputs: int
    layers: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    input_shapes: list[tuple[int, ...] | None] = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        """True for stage 0 (receives nothing)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage (sends nothing, returns the loss)."""
        return self.stage == self.num_stages - 1


__all__ = ["StageGraph"]
