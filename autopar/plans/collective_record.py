"""One collective of a training step as the plan predicts it (``plan.collectives()``;
the search lists them: :mod:`autopar.search.step_collectives`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Collective:
    """One collective of a step on one rank."""

    phase: str
    """``"forward"``, ``"backward"`` or ``"step"`` (once per step outside them:
    ZeRO-1/2's all-gather of the updated shards, issued at the next forward; a
    pipeline's loss broadcast; the micro-batches' target counts summed before them)."""
    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, or for a
    pipeline ``send``, ``recv`` (group 2: the two ranks) and ``broadcast``."""
    axes: tuple[int, ...]
    """Mesh axes the group spans (one group over all of them)."""
    group: int
    """Ranks in the group."""
    bytes: int
    """What this rank puts in: the all-reduced tensor, the shard gathered, the whole
    tensor reduce-scattered."""
    what: str
    """The edge (``"node <- input"``), bucket or layer it serves."""
    count: int = 1
    """Times per step (micro-batches for forward and backward collectives)."""
    stage: int = 0
    """Pipeline rank (stage of the pipeline axis) whose ranks issue it; 0 without a
    pipeline."""

    def wire_bytes(self, reduce_scatter_as_all_reduce: bool = False) -> float:
        """Bytes this rank sends for one run of it with ring algorithms: an all-reduce
        ``2(g-1)/g`` of the tensor, an all-gather ``g-1`` shards, a reduce-scatter
        ``(g-1)/g`` of its input (gloo runs it as an all-reduce of the input:
        ``reduce_scatter_as_all_reduce``), an all-to-all ``(g-1)/g``, a send the tensor,
        a receive nothing; a broadcast is counted once (its root's share)."""
        g, b = self.group, self.bytes
        f = (g - 1) / g if g > 1 else 0.0
        if self.kind == "reduce_scatter" and reduce_scatter_as_all_reduce:
            return 2 * f * b
        return {"all_reduce": 2 * f * b, "all_gather": (g - 1) * b, "reduce_scatter": f * b,
                "all_to_all": f * b, "send": b, "broadcast": b / g if g else 0.0}.get(self.kind, 0.0)

    def to_dict(self) -> dict:
        """JSON form (tuples as lists)."""
        d = asdict(self)
        d["axes"] = list(self.axes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Collective:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "axes": tuple(d["axes"])})


__all__ = ["Collective"]
