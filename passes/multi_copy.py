"""Multi-copy overlap (decision ``copies``; MindSpore's multi-copy parallelism): the
graph, lowered at half the batch, runs twice in one forward, on the two halves of each
batched input, its ops interleaved so that one copy's collectives run while the other
copy computes.

Before: a lowered graph returning one scalar loss (a mean over its batch), captured at
the size of one copy.  After: the same placeholders, taking ``copies`` times that batch;
every node that depends on an input exists once per copy, the others (parameters, their
casts, ZeRO-3's gathers) once, shared; the collectives of
:mod:`autopar.runtime.collectives` become a start and a wait
(:mod:`autopar.runtime.overlap`); the output is the whole batch's loss from the
copies' (weighted by their targets, as a pipeline's micro-batches are).

Order: each copy's nodes are cut into segments after each collective start, and the
segments are emitted copy after copy (``A0 B0 A1 B1 ...``); a copy's wait comes right
before its result's first use, in its next segment, so the other copy's segment runs
between a start and its wait.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.runtime import collectives as C
from autopar.runtime import overlap, token_weights

_SPLIT = {C.all_reduce: "all_reduce", C.all_gather: "all_gather",
          C.reduce_scatter: "reduce_scatter", C.all_to_all: "all_to_all"}


def copy_part(x, want: tuple[int, ...] | None, part: int, parts: int):
    """Copy ``part`` of ``parts`` of input ``x`` captured as ``want``: its rows
    ``part`` of ``parts`` equal chunks when its first dim is ``parts`` times the
    captured one, else ``x`` whole (an input without a batch dim)."""
    if isinstance(x, torch.Tensor) and want is not None and x.dim() >= 1 \
            and tuple(x.shape[1:]) == tuple(want[1:]) and x.shape[0] == parts * want[0] and parts > 1:
        return x.chunk(parts, dim=0)[part]
    return x


def mean_loss(*losses: torch.Tensor) -> torch.Tensor:
    """The copies' losses averaged (each is its half's mean)."""
    return torch.stack(losses).mean()


def sum_loss(*losses: torch.Tensor) -> torch.Tensor:
    """The copies' losses summed (each its part of a sum over a count passed in)."""
    return torch.stack(losses).sum()


def _batch_loss(new: fx.Graph, gm: fx.GraphModule, losses: tuple, lookup, copies: int) -> fx.Node:
    """The whole batch's loss from the copies' (:mod:`autopar.runtime.token_weights`):
    a cross-entropy's copies weighted by their counts of targets (padding falls
    unevenly), summed for a sum over a count passed in, else averaged."""
    found = token_weights.loss_targets(gm, {n for n in gm.graph.nodes if n.op == "placeholder"})
    if found is token_weights.GIVEN_COUNT:
        return new.call_function(sum_loss, losses)
    if found is None or (found.rows and found.count is None):
        return new.call_function(mean_loss, losses)
    # each copy's count as its loss divided by it: the lowering's own sum over the row
    # axes (no collective more than the plan lists), or a local one where rows are whole
    counts = tuple(new.call_function(token_weights.waited, (lookup(found.count, c),)) if found.count
                   else new.call_function(token_weights.target_count, (lookup(found.target, c), found.ignore, ()))
                   for c in range(copies))
    return new.call_function(token_weights.weighted_loss, (losses, counts))


def multi_copy(gm: fx.GraphModule, copies: int = 2) -> fx.GraphModule:
    """``gm`` run as ``copies`` interleaved copies (see the module docstring)."""
    g = gm.graph
    nodes = list(g.nodes)
    out = next(n for n in nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    if len(flat) != 1:
        raise ValueError(f"multi_copy needs a graph returning its loss alone, got {len(flat)} outputs")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    dep = set(placeholders)  # nodes computed per copy: those depending on an input
    for n in nodes:
        if n.op not in ("placeholder", "output", "get_attr") and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    new = fx.Graph()
    shared: dict[fx.Node, fx.Node] = {}
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(copies)]
    pending: list[dict[fx.Node, fx.Node]] = [{} for _ in range(copies)]
    for p in placeholders:
        q = new.placeholder(p.target)
        q.meta = dict(p.meta)
        val = p.meta.get("val")
        want = tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None
        for c in range(copies):
            envs[c][p] = new.call_function(copy_part, (q, want, c, copies))

    def lookup(a: fx.Node, c: int) -> fx.Node:
        if a in pending[c]:  # first use of a started collective: wait for it here
            envs[c][a] = new.call_function(overlap.wait, (pending[c].pop(a),))
        return envs[c][a] if a in dep else shared[a]

    def emit(n: fx.Node, c: int) -> None:
        if n not in dep:
            if n not in shared:
                shared[n] = new.node_copy(n, lambda a: lookup(a, c))
            return
        kind = _SPLIT.get(n.target) if n.op == "call_function" else None
        if kind is not None:
            args = tuple(lookup(a, c) if isinstance(a, fx.Node) else a for a in n.args)
            pending[c][n] = new.call_function(overlap.start, (kind, *args))
            return
        envs[c][n] = new.node_copy(n, lambda a: lookup(a, c))

    # segments: each copy's body cut after each collective it starts
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    segments: list[list[fx.Node]] = [[]]
    for n in body:
        segments[-1].append(n)
        if n in dep and n.op == "call_function" and n.target in _SPLIT:
            segments.append([])
    for seg in segments:
        for c in range(copies):
            for n in seg:
                emit(n, c)
    losses = tuple(lookup(flat[0], c) for c in range(copies))
    loss = _batch_loss(new, gm, losses, lookup, copies)
    new.output((loss,) if isinstance(out.args[0], (tuple, list)) else loss)
    new.lint()
    return fx.GraphModule(gm, new)


__all__ = ["copy_part", "mean_loss", "multi_copy", "sum_loss"]
