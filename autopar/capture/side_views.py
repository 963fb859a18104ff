"""Give every user of a repeated layer's view of a shared input its own copy of the view.

Hugging Face decoders compute the rotary tables once and each layer takes views of them
(``cos.unsqueeze(1)`` in ``apply_rotary_pos_emb``) that feed both the query and the key
rotation. One view node with two users ties the layouts of the query and key paths
together: the layer is then no longer series-parallel between its input and its output,
so the repeated-layer solver (:mod:`autopar.search.solvers.cluster`) cannot reduce it to a
2-terminal transfer, and each consumer is forced to read the view in one shared layout.

A view is free and the same numbers whichever node computes it, so copying it per user
changes neither the result nor the step's cost; it gives each consumer its own layout
choice and makes the layer a chain link again.

Before: a view node inside a repeated layer whose tensor inputs come from outside the layer
(or from other such views) with ``k >= 2`` users.
After: ``k`` view nodes, one per user, each with the original's metadata (module stack,
shapes), inserted right after the original.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.layers import layers

aten = torch.ops.aten

VIEW_OPS = frozenset({
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.alias.default,
})
"""Ops whose result is a view of their input: free to compute once per user."""


def duplicate_side_views(gm: fx.GraphModule, recompile: bool = True) -> int:
    """Copy each shared-input view of a repeated layer once per extra user (see the module
    docstring); returns how many copies were made and recompiles ``gm`` when any were
    (unless ``recompile=False``: the caller does it)."""
    made = 0
    for lay in layers(gm):
        if not lay.repeated:
            continue
        inside = set(lay.nodes)
        side_derived: set[fx.Node] = set()
        for n in lay.nodes:  # graph order: a view's inputs are classified before it
            if n.op == "call_function" and n.target in VIEW_OPS and all(
                    u not in inside or u in side_derived for u in n.all_input_nodes):
                side_derived.add(n)
        for n in reversed(lay.nodes):  # later views first: their copies add users upstream
            if n not in side_derived:
                continue
            for user in list(n.users)[1:]:
                with gm.graph.inserting_after(n):
                    twin = gm.graph.node_copy(n)
                user.replace_input_with(n, twin)
                made += 1
    if made:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return made


__all__ = ["VIEW_OPS", "duplicate_side_views"]
