"""Inline ``torch.no_grad()`` regions that ``torch.export`` wrapped in a higher-order op.

Before: the captured graph may hold ``wrap_with_set_grad_enabled(False, submod_k, *xs)``
calls (Hugging Face rotary embeddings run their ``forward`` under ``@torch.no_grad()``),
each reading a sub-``GraphModule`` through a ``get_attr`` node.  Such a call has no
sharding rule (it ran replicated with a warning), and its ``GraphModule`` attribute is
no tensor, so ``ParallelModule.export`` could not write it.

After: the sub-graph's nodes stand in the main graph in its place; with grad disabled
each result is ``aten.detach``-ed (exactly what ``no_grad`` gives: no gradient flows back
through the region) and marked :data:`KEEP_REPLICATED`, with grad enabled the results
are used as they are.  The sub-module and its ``get_attr`` are gone, ``getitem`` users
read the inlined results.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten
KEEP_REPLICATED = "autopar_keep_replicated"
"""Meta key on a no_grad region's results: they keep the one strategy the region had as a
single op, all-replicated (small tables; shared by every layer, their layouts would
multiply the repeated-layer solver's side inputs: autopar/search/solvers/cluster.py)."""


def _is_grad_region(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == \
        "wrap_with_set_grad_enabled"


def _copy_region(g: fx.Graph, sub: fx.Graph, operands: list[object]) -> list[object]:
    """Copy ``sub``'s nodes into ``g`` at its insertion point, its placeholders bound to
    ``operands``; returns what its output returns, as a list."""
    env: dict[fx.Node, object] = {}
    inputs = iter(operands)
    result: object = None
    for n in sub.nodes:
        if n.op == "placeholder":
            env[n] = next(inputs)
        elif n.op == "output":
            result = fx.map_arg(n.args[0], env.__getitem__)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _detached(g: fx.Graph, x: object) -> object:
    if not isinstance(x, fx.Node):
        return x
    d = g.call_function(aten.detach.default, (x,))
    d.meta.update({k: v for k, v in x.meta.items() if k in ("val", "tensor_meta")})
    d.meta[KEEP_REPLICATED] = True
    return d


def inline_grad_regions(gm: fx.GraphModule, recompile: bool = True) -> int:
    """Inline every grad-mode region of ``gm`` in place; returns how many there were.
    ``recompile=False`` leaves regenerating ``gm``'s code to the caller (capture runs
    several passes and recompiles once: each recompile of an 8B Llama costs ~0.1 s)."""
    g = gm.graph
    regions = [n for n in g.nodes if _is_grad_region(n)]
    for node in regions:
        enabled, sub_attr, *operands = node.args
        with g.inserting_before(node):
            outs = _copy_region(g, getattr(gm, sub_attr.target).graph, operands)
            if not enabled:
                outs = [_detached(g, o) for o in outs]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
        if node.users:  # a single (non-tuple) result used directly
            node.replace_all_uses_with(outs[0])
        g.erase_node(node)
        if not sub_attr.users:
            g.erase_node(sub_attr)
            delattr(gm, sub_attr.target)
    if regions:
        g.lint()
        if recompile:
            gm.recompile()
    return len(regions)


def mark_tables(gm: fx.GraphModule) -> int:
    """Mark :data:`KEEP_REPLICATED` every computed tensor that reads no model input and
    no parameter, only buffers, constants and shapes, and is not batch-shaped: rotary
    cos/sin tables, position ids (a causal mask of the batch's shape keeps its layouts:
    split with the batch it costs a rank its share only).  transformers 5.24's Llama
    computes its rotary tables without a ``no_grad`` region, so
    :func:`inline_grad_regions` no longer marks them; with 16 layouts each, the tables
    made the repeated-layer solver's side inputs 6,400 layouts and clustering gave up.
    Replicated, a consumer that wants one sharded slices it locally, for free.  Returns
    how many nodes were marked."""
    params = {name for name, _ in gm.named_parameters()}
    # the batch as the first input's dim 0, read without int(): under a symbolic-batch
    # capture that would specialise the batch to the traced size
    batch = next((v.shape[0] for n in gm.graph.nodes if n.op == "placeholder"
                  for v in [n.meta.get("val")] if isinstance(v, torch.Tensor) and v.dim()), None)
    reads_input: set[fx.Node] = set()
    marked = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder" or (n.op == "get_attr" and n.target in params):
            reads_input.add(n)
        elif n.op == "call_function":
            if any(a in reads_input for a in n.all_input_nodes):
                reads_input.add(n)
            elif _table(n.meta.get("val"), batch) and not n.meta.get(KEEP_REPLICATED):
                n.meta[KEEP_REPLICATED] = True
                marked += 1
    return marked


def _table(v: object, batch: object) -> bool:
    """A tensor that is not batch-shaped: dim 0 neither symbolic (a symbolic-batch
    capture's batch) nor the concrete batch."""
    if not isinstance(v, torch.Tensor):
        return False
    if not v.dim():
        return True
    d0 = v.shape[0]
    if not isinstance(d0, int):
        return False
    return not (isinstance(batch, int) and d0 == batch)
