"""The routed experts op ``autopar::moe_experts`` (autopar/runtime/experts.py): inputs
hidden ``[T, H]``, top-k index and weights ``[T, k]``, gate_up ``[E, 2I, H]``, down
``[E, H, I]``; output ``[T, H]``.

Per mesh axis:
- **tokens** split (hidden, index, weights and output ``S(0)``), experts whole: data
  parallel, no communication;
- **expert parallel**: tokens split and both expert tensors split on ``E`` (``S(0)``):
  each routed row travels to its expert's rank and back by uneven all-to-alls
  (:func:`autopar.runtime.experts.expert_parallel`);
- **experts only** split (``S(0)``), tokens whole: each rank adds its experts' share,
  the output is Partial (:func:`autopar.runtime.experts.partial_experts`).

The expert tensors' hidden dims are not split (gate and up are concatenated in one
tensor: a Shard of dim 1 would not give a rank matching gate and up rows).  The mesh
check keeps the experts split over at most one axis (one expert-parallel group).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg
from autopar.plans.placement import P, Placements, fmt_placements
from autopar.runtime.experts import MOE_EXPERTS, expert_parallel, partial_experts
from autopar.sharding.rules import AxisStrategy, OpStrategy, RuleCtx, assign, register


def _parts(node: fx.Node) -> tuple:
    return tuple(arg(node, i, n) for i, n in enumerate(
        ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj", "act")))


def expert_axes(s_inputs: Sequence[Placements]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(expert-parallel axes, experts-only axes) of a strategy's input placements (in
    ``tensor_inputs`` order: hidden, index, weights, gate_up, down)."""
    hidden, gate_up = s_inputs[0], s_inputs[3]
    split = [a for a, p in enumerate(gate_up) if p == Shard(0)]
    ep = tuple(a for a in split if hidden[a] == Shard(0))
    return ep, tuple(a for a in split if a not in ep)


def _mesh_ok(node: fx.Node, s: OpStrategy, mesh_shape: Sequence[int]) -> bool:
    ep, only = expert_axes(s.inputs)
    return len(ep) + len(only) <= 1


@register(MOE_EXPERTS, mesh_check=_mesh_ok)
def experts_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Tokens split (DP), tokens and experts split (EP), or experts split (Partial)."""
    h, idx, w, gu, dn, _ = _parts(node)
    tokens = [(h, Shard(0)), (idx, Shard(0)), (w, Shard(0))]
    experts = [(gu, Shard(0)), (dn, Shard(0))]
    out = [assign(node, tokens, [Shard(0)]), assign(node, tokens + experts, [Shard(0)]),
           assign(node, experts, [P])]
    return [s for s in out if s is not None]


def localize_experts(node: fx.Node, ins: list[Placements], mesh: tuple[int, ...]) -> None:
    """Swap the node for its local form under input placements ``ins`` (see the module
    docstring); tokens-only and replicated layouts keep the op itself."""
    ep, only = expert_axes(ins)
    if len(ep) + len(only) > 1:
        raise ValueError(f"{node.name}: experts split over several mesh axes "
                         f"{[fmt_placements(p) for p in ins]}: not lowered")
    if not ep and not only:
        return
    node.target = expert_parallel if ep else partial_experts
    node.args = (*_parts(node), (ep or only)[0])
    node.kwargs = {}


__all__ = ["expert_axes", "experts_rule", "localize_experts"]
