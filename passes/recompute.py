"""Recomputation (activation checkpointing) of chosen layers, as a graph transform.

Before: a GraphModule whose nodes carry ``node.meta["autopar_layer"]`` (set by
:func:`autopar.passes.lower.tag_layers`; for a captured, unlowered graph the tags are
read from ``nn_module_stack`` with :func:`autopar.capture.layers.layer_keys`).  The computing
nodes of each layer to recompute form one contiguous run in graph order, except for
nodes that read no activation (a ZeRO-3 ``zero_gather`` of the layer's parameter,
emitted at the top of the graph), which are first moved down to their first use.

After: each such run is moved into a submodule ``recompute_<key>`` (a GraphModule
with no parameters of its own) and replaced by one call::

    checkpoint(self.recompute_<key>, *inputs)

(:func:`checkpoint`: ``torch.utils.checkpoint.checkpoint`` non-reentrant, no early stop,
replaying the dropout generator)
so the layer's intermediate activations are dropped after the forward and recomputed
in backward; only the segment's inputs stay alive.  Parameters and buffers are *inputs*
of the submodule (the ``get_attr`` nodes stay in the outer graph), so gradients land
on the very Parameter objects the module holds, and a later pass that moves or
replaces a parameter needs to know nothing about recomputation.  The new nodes (the
submodule reference, the call and one ``getitem`` per output when the layer has
several) keep the layer's ``autopar_layer`` tag, so a stage splitter cutting along the
tags afterwards keeps each call in its layer's stage.

Order with other passes: run it on the per-rank graph after lowering and after
ZeRO's rewrite (:meth:`autopar.runtime.zero.Zero.install`), before stage splitting.
Run before ZeRO-3's rewrite, the gather of a recomputed layer's parameter would land
outside the checkpoint and the checkpoint would hold the whole parameter as an input.

Collectives: a lowered graph calls the autograd collectives of
:mod:`autopar.runtime.collectives` inside layers.  Recomputing a layer re-issues its
forward collectives during backward.  This stays deterministic across ranks because
every rank runs the same graph, so the autograd engine reaches the same checkpoints in
the same order on every rank.  ``early_stop=False`` is what makes the *set* of
re-issued collectives identical too: with early stopping, recomputation stops after
the last tensor the backward needs, and that point can differ between ranks (e.g.
:func:`~autopar.runtime.collectives.to_partial` multiplies by zero on some ranks
only, which saves a tensor there and not elsewhere), so one rank could skip a
collective that another issues and both would hang.

Example (examples/gpt.py, 2 blocks, ``recompute(gm, {"blocks.0"})``)::

    recompute_blocks_0 = self.recompute_blocks_0
    blocks_0 = autopar_passes_recompute_checkpoint(recompute_blocks_0, add,
        blocks_0_ln1_weight, ..., blocks_0_mlp_fc2_bias);  recompute_blocks_0 = add = ... = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(blocks_0, [64], ...)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.utils.checkpoint
from torch import fx

from autopar.capture.layers import layer_keys
from autopar.runtime.rng import replay_contexts

TAG = "autopar_layer"
# node kinds that compute; get_attr and placeholder nodes sit at the top of the graph
# (away from their layer's ops), so they never break a layer's contiguity
_COMPUTE = ("call_function", "call_method", "call_module")
# meta entries copied from a layer's output node to the node that replaces it, so later
# passes (stage splitting needs shapes for send/recv buffers) still read them
_KEEP_META = ("val", "tensor_meta", "autopar")


class RecomputeError(ValueError):
    """A layer cannot be recomputed as asked (unknown key, or not contiguous)."""



@torch.fx.wrap
def checkpoint(fn, *inputs):
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant, no early stop, so every rank
    re-issues the same collectives) whose recomputation replays the dropout generator's
    state (:mod:`autopar.runtime.rng`), so a recomputed mask is the forward's.  Under
    ``torch.compile`` dynamo takes no ``context_fn`` but its own selective ones (it would
    give up on the whole graph): there the checkpoint is dynamo's, whose partitioner
    replays or keeps random ops itself, as for a user's ``torch.compile`` of a
    checkpointed model."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False, early_stop=False,
                                             context_fn=replay_contexts)


def _tags(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Layer key per node: the lowering's tags, else read from ``nn_module_stack``."""
    if all(TAG in n.meta for n in gm.graph.nodes):
        return {n: n.meta[TAG] for n in gm.graph.nodes}
    return layer_keys(gm)


def _sink_parameter_side(order: list[fx.Node], tags: dict[fx.Node, str], key: str) -> list[fx.Node]:
    """Move the layer's *parameter-side* nodes (no activation among their inputs, e.g.
    ZeRO-3's ``zero_gather`` emitted next to its parameter at the top of the graph)
    down to just before their first user when that user is in the layer.

    The move keeps every node before its users, so it is always legal; it reorders
    only nodes that read no activation, and identically on every rank (collectives
    among them stay in the same order everywhere).  Inside the segment a ZeRO-3 gather
    is recomputed in backward instead of its whole parameter being held by the
    checkpoint.  Returns the node list in the new order; the graph is not touched."""
    mine = [n for n in order if n.op in _COMPUTE and tags.get(n) == key]
    side: set[fx.Node] = set()
    for n in mine:
        if all(a.op in ("get_attr", "placeholder") or a in side for a in n.all_input_nodes):
            side.add(n)
    for n in reversed(mine):  # users first, so a chain lands in order
        if n not in side or not n.users:
            continue
        pos = {m: i for i, m in enumerate(order)}
        first = min(n.users, key=pos.__getitem__)
        if tags.get(first) == key and pos[first] > pos[n] + 1:
            order.remove(n)
            order.insert(order.index(first), n)
    return order


def _segment(order: list[fx.Node], tags: dict[fx.Node, str], key: str) -> list[fx.Node]:
    """The computing nodes of layer ``key`` in ``order``; raises unless contiguous."""
    compute = [n for n in order if n.op in _COMPUTE]
    idx = [i for i, n in enumerate(compute) if tags.get(n) == key]
    if not idx:
        known = sorted({tags[n] for n in compute if n in tags})
        raise RecomputeError(f"no computing node is tagged with layer {key!r}; layers: {known}")
    stray = [compute[i] for i in range(idx[0], idx[-1] + 1) if tags.get(compute[i]) != key]
    if stray:
        raise RecomputeError(
            f"layer {key!r} is not contiguous in graph order: {stray[0].name} (layer "
            f"{tags.get(stray[0])!r}) sits between its first node {compute[idx[0]].name} and "
            f"its last node {compute[idx[-1]].name}; recomputation wraps one contiguous run")
    return [compute[i] for i in idx]


def _attr_name(gm: fx.GraphModule, key: str) -> str:
    base = "recompute_" + re.sub(r"\W", "_", key)
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def _outline(gm: fx.GraphModule, seg: list[fx.Node], key: str) -> None:
    """Replace the nodes ``seg`` of ``gm`` by one checkpointed call of a new submodule."""
    inside = set(seg)
    inputs: list[fx.Node] = []
    for n in seg:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in seg if any(u not in inside for u in n.users)]
    if not outputs:
        raise RecomputeError(f"layer {key!r} has no output used outside it: nothing to recompute")

    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = {k: v for k, v in a.meta.items() if k in _KEEP_META}
    for n in seg:
        env[n] = body.node_copy(n, lambda x: env[x])
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    body.lint()
    name = _attr_name(gm, key)
    # root=gm: a call_module inside the layer keeps its module (aten graphs have none)
    gm.add_submodule(name, fx.GraphModule(gm, body, class_name=name))

    g = gm.graph
    with g.inserting_after(seg[-1]):
        fn = g.get_attr(name)
    with g.inserting_after(fn):
        call = g.create_node("call_function", checkpoint, (fn, *inputs), {},
                             name=re.sub(r"\W", "_", key))
    fn.meta[TAG] = call.meta[TAG] = key
    if len(outputs) == 1:
        replacements = [call]
        call.meta.update({k: outputs[0].meta[k] for k in _KEEP_META if k in outputs[0].meta})
    else:
        replacements = []
        last = call
        for i, o in enumerate(outputs):
            with g.inserting_after(last):
                last = g.call_function(operator.getitem, (call, i))
            last.meta[TAG] = key
            last.meta.update({k: o.meta[k] for k in _KEEP_META if k in o.meta})
            replacements.append(last)
        if all("val" in o.meta for o in outputs):
            call.meta["val"] = tuple(o.meta["val"] for o in outputs)
    for o, r in zip(outputs, replacements):
        o.replace_all_uses_with(r, delete_user_cb=lambda u: u not in inside)
    for n in reversed(seg):
        g.erase_node(n)


def recompute(gm: fx.GraphModule, keys: Iterable[str]) -> fx.GraphModule:
    """Recompute the layers ``keys`` (e.g. ``{"blocks.1", "blocks.3"}``) in backward.

    Transforms ``gm`` in place and returns it; see the module docstring for the
    contract.  The forward computes the same values with the same ops in the same
    order, so losses and gradients are bitwise equal to the unrecomputed module's.
    Layers already recomputed are left as they are.  Raises :class:`RecomputeError`
    for a key no node carries or a layer whose nodes are interleaved with another
    layer's.
    """
    keys = set(keys)
    if not keys:
        return gm
    tags = _tags(gm)
    # idempotent: a layer already outlined is one checkpoint call carrying its tag
    keys -= {tags.get(n) for n in gm.graph.nodes if n.target is checkpoint}
    # plan on a copy of the node order: one bad key raises before the graph changes
    order = list(gm.graph.nodes)
    for k in keys:
        order = _sink_parameter_side(order, tags, k)
    segs = sorted(((k, _segment(order, tags, k)) for k in keys), key=lambda ks: order.index(ks[1][0]))
    # apply the new order: each node goes right before its successor, back to front
    for n, nxt in reversed(list(zip(order, order[1:]))):
        if n.next is not nxt:
            nxt.prepend(n)
    for key, seg in segs:
        _outline(gm, seg, key)
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["RecomputeError", "recompute"]
