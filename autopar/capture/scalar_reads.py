"""Make ``.item()`` (and ``float(t)``, ``int(t)``, ``bool(t)``) read the whole value.

Before: a forward that turns a tensor into a Python number (``scale = h.abs().mean().item()``)
is captured as ``aten.item(mean)``, an op with no tensor output and so no strategy.  Its
input could be planned sharded or ``Partial`` (a batch-split mean is a partial sum on each
rank), and the number each rank read was its own part: the loss came out silently wrong.

After: every such read goes through an ``aten.detach`` marked
:data:`~autopar.capture.grad_regions.KEEP_REPLICATED`, which has only the all-replicate
strategy, so the plan pays the redistribution of a scalar (an all-reduce of a ``Partial``,
an all-gather of a shard) on that edge and every rank reads the same, whole value.  The
read stays in the graph: it is recomputed on every call, as in eager (``item`` detaches,
so no gradient flows through it in either).
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.grad_regions import KEEP_REPLICATED

aten = torch.ops.aten
SCALAR_READS = frozenset({aten.item.default, aten._local_scalar_dense.default})


def replicate_scalar_reads(gm: fx.GraphModule) -> int:
    """Route the input of every :data:`SCALAR_READS` node of ``gm`` through a replicated
    ``detach`` (in place; the caller recompiles).  Returns how many reads were routed."""
    g = gm.graph
    reads = [n for n in g.nodes if n.op == "call_function" and n.target in SCALAR_READS
             and isinstance(n.args[0], fx.Node)]
    for n in reads:
        src = n.args[0]
        with g.inserting_before(n):
            d = g.call_function(aten.detach.default, (src,))
        d.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta")})
        d.meta[KEEP_REPLICATED] = True
        n.replace_input_with(src, d)
    return len(reads)


__all__ = ["SCALAR_READS", "replicate_scalar_reads"]
