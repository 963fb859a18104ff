"""Factory ops (``arange``, ``full``, ``zeros``...): no tensor input, so nothing is
gathered to run them; each rank builds the whole tensor (replicated), and a sharded
consumer slices its piece locally for free.  A sharded output would need a local form
that builds only this rank's piece: not worth it for index ramps and constants."""

from __future__ import annotations

import torch
from torch import fx

from autopar.sharding.rules import AxisStrategy, RuleCtx, register

aten = torch.ops.aten

FACTORIES = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.linspace.default,
]


@register(*FACTORIES)
def factory_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Only the all-replicate strategy the registry always adds."""
    return []
