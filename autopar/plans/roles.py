"""What each mesh axis does in a plan, read from its placements, and the layout in one
phrase (``TP8 (intra-node) x DP2 (inter-node), ZeRO-1``).

Axis roles are read from the placements, not from the search's internals, so a plan
loaded from JSON reads the same: an axis is *DP* when most compute runs on inputs split
on the batch dim over it (or the model's inputs are, most compute runs split and its weights are not), *TP* when most weight bytes of the repeated layers (all
layers' when there are none) are split over it instead, *SP*
when activations are split on the sequence dim only, *CP* when attention itself runs on
sequence chunks over it (``+CP`` beside another role), *EP* when stacks of per-expert
weights (3-D parameters) are split on their expert dim over it (``DP+EP``: dense layers
data parallel, experts split), and *FSDP* when it is DP with the
weights split too (gathered per use).

They live beside the plan's records, not in :mod:`autopar.report`, because the search
describes the runner-up mesh shapes in these words too (:mod:`autopar.search.mesh_shapes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.plans.placement import is_shard, parse_placements
from autopar.plans.splits import pipeline_mesh

if TYPE_CHECKING:
    from autopar.plans.data import Plan

__all__ = ["AxisRole", "axis_roles", "layout"]

_SDPA = "scaled_dot_product_attention"  # NodePlan.op of an attention node


@dataclass(frozen=True)
class AxisRole:
    """What one mesh axis does in a plan: ``kind`` is PP, DP, FSDP, TP, TP+SP, SP, CP, EP
    (or one of them ``+EP`` / ``+CP``) or R (replicated: the axis does no useful split); ``link`` says where its ranks sit
    (intra-node, inter-node, spans nodes, one host)."""

    name: str
    size: int
    kind: str
    link: str
    zero: int = 0

    def short(self) -> str:
        """``"TP8 (intra-node)"``, ``"rep2 (inter-node)"``: the form :func:`layout` uses."""
        text = f"{'rep' if self.kind == 'R' else self.kind}{self.size} ({self.link})"
        return text + (f", ZeRO-{self.zero}" if self.zero else "")

    def words(self) -> str:
        """``"TP8 (intra-node)"``, ``"DP2 (inter-node), ZeRO-1"``."""
        text = (f"replicated x{self.size} ({self.link}: every rank does the same work)"
                if self.kind == "R" else f"{self.kind}{self.size} ({self.link})")
        return text + (f", ZeRO-{self.zero}" if self.zero else "")


def _link_words(mesh, axis: int) -> str:
    link = mesh.links[axis]
    if mesh.gpus_per_node is None:
        return "one host"
    if link.inter is not None:
        return "spans nodes"
    if mesh.inter is not None and link == mesh.inter and link != mesh.intra:
        return "inter-node"
    return "intra-node"


def _shard_dims(text: str, axis: int) -> int | None:
    pl = parse_placements(text)
    return pl[axis].dim if axis < len(pl) and is_shard(pl[axis]) else None


def axis_roles(plan: Plan) -> list[AxisRole]:
    """The role of every mesh axis, the pipeline axis first when the plan has stages
    (sizes of 1 included, as kind ``R``)."""
    d = plan.decisions
    mesh = plan.mesh
    roles: list[AxisRole] = []
    if d.pipeline_stages > 1:
        full = pipeline_mesh(plan)
        roles.append(AxisRole("pp", d.pipeline_stages, "PP", _link_words(full, 0)))
    params = [n for n in plan.nodes.values() if n.kind == "param" and n.shape and len(n.shape[0]) >= 2]
    # the repeated layers decide (a large embedding and head must not outvote them); a
    # model without repeated layers is judged on all its weights
    params = [n for n in params if n.layer not in ("", "pre", "post")] or params
    # stacks of per-expert matrices ([experts, in, out]) make an axis EP when split on the
    # expert dim; the other weights alone decide TP/FSDP (experts would outvote them)
    experts = [n for n in params if len(n.shape[0]) == 3]
    expert_total = sum(math.prod(n.shape[0]) for n in experts) or 1.0
    params = [n for n in params if len(n.shape[0]) != 3] or params
    weight_total = sum(math.prod(n.shape[0]) for n in params) or 1.0
    ops = [n for n in plan.nodes.values() if n.kind == "op" and n.flops > 0 and n.in_placements]
    flop_total = sum(n.flops for n in ops) or 1.0
    for a, (name, size) in enumerate(zip(mesh.axis_names, mesh.shape)):
        if mesh.size == 1 and d.pipeline_stages > 1:
            break  # one rank per stage: the sub-mesh is a placeholder axis
        weights = sum(math.prod(n.shape[0]) for n in params
                      if _shard_dims(n.out_placements[0], a) is not None) / weight_total
        batch = sum(n.flops for n in ops if _shard_dims(n.in_placements[0], a) == 0) / flop_total
        seq = sum(1 for n in plan.nodes.values() if n.kind == "op" and n.in_placements
                  and n.shape and len(n.shape[0]) == 3 and _shard_dims(n.in_placements[0], a) == 1)
        # context parallel: attention itself runs on sequence chunks over this axis
        cp = any(n.op == _SDPA and _shard_dims(n.in_placements[0], a) == 2 for n in ops)
        # the model's inputs split on the batch over this axis and most FLOPs on split
        # tensors: data parallel even where the batch (MoE groups) is not their dim 0
        fed = any(n.kind == "input" and n.out_placements and n.shape and len(n.shape[0]) >= 1
                  and _shard_dims(n.out_placements[0], a) == 0 for n in plan.nodes.values())
        split = sum(n.flops for n in ops
                    if any(_shard_dims(p, a) is not None for p in n.in_placements)) / flop_total
        if batch > 0.5 or (fed and split > 0.5 and weights <= 0.5 and not seq):
            kind = "FSDP" if weights > 0.5 else "DP"
        elif weights > 0.5:
            kind = "TP+SP" if seq else "TP"
        elif seq:
            kind = "SP"
        else:
            kind = "R"
        cut = {n.name: _shard_dims(n.out_placements[0], a) for n in experts}
        ep = sum(math.prod(n.shape[0]) for n in experts if cut[n.name] == 0) / expert_total > 0.5
        # each expert's matrices split (Megatron inside the experts): tensor parallel
        etp = not ep and sum(math.prod(n.shape[0]) for n in experts
                             if cut[n.name] not in (None, 0)) / expert_total > 0.5
        for flag, tag in ((ep, "EP"), (etp and "TP" not in kind, "TP"), (cp, "CP")):
            if flag:
                kind = tag if kind in ("SP", "R") else f"{kind}+{tag}"
        zero = d.zero_stage if a in d.zero_axes and size > 1 else 0
        roles.append(AxisRole(name, size, kind, _link_words(mesh, a), zero))
    return roles


def layout(plan: Plan) -> str:
    """The layout in one phrase: ``"PP2 (1f1b, 8 micro-batches) x TP8 (intra-node) x DP2
    (inter-node), ZeRO-1"``; axes of size 1 are left out."""
    parts = []
    d = plan.decisions
    roles = axis_roles(plan)
    # ZeRO over several axes is one group: said once, after them
    spanning = [r.name for r in roles if r.zero and r.size > 1]
    for r in roles:
        if r.size == 1:
            continue
        if r.kind == "PP":
            chunks = f" x {d.virtual_stages} chunks per stage" if d.virtual_stages > 1 else ""
            parts.append(f"PP{r.size} ({r.link}; {d.schedule}{chunks}, {d.micro_batches} "
                         "micro-batches)")
        else:
            parts.append(dataclasses.replace(r, zero=0).short() if len(spanning) > 1 else r.short())
    text = " x ".join(parts) or "one device (nothing to split)"
    if len(spanning) > 1:
        text += f", ZeRO-{d.zero_stage} over {' and '.join(spanning)} as one group"
    return text
