"""Which values of a captured graph receive a gradient in the backward.

A redistribution in the forward has a dual collective in the backward only where a
gradient flows back through it: its tensor depends on a trainable parameter and its
consumer lies on the path from the parameters to the output that is differentiated.
A model that returns its loss and its logits (a Hugging Face ``...ForCausalLM`` called
with labels) is differentiated through ``loss`` alone: gathering the logits for the
caller costs an all-gather in the forward and nothing in the backward, since autograd
never reaches a gather whose result no loss uses.  Priced and listed with a dual it
was wrong twice: ``plan.collectives()`` listed a reduce-scatter that never ran, and
the planner, seeing the same price on both sides, could move the gather onto the
loss's path, where its dual does run (a tiny Llama's data-parallel plan did, once a
no-op cast became free).

:func:`mark_gradients` writes :attr:`autopar.capture.ir.NodeInfo.backward` (the node's value
receives a gradient) and :attr:`autopar.capture.ir.NodeInfo.returned_grad` (the value returned
to the caller does) into every node; :func:`dual` answers for one edge.
"""

from __future__ import annotations

from torch import fx
from torch.utils import _pytree as pytree

from autopar.capture.ir import META_KEY, info


def differentiated(gm: fx.GraphModule) -> set[fx.Node]:
    """The outputs a training step differentiates: the only floating-point output, else
    the one named ``loss`` in the model's output structure (a Hugging Face
    ``ModelOutput``, a dict), else every output (nothing is known, so nothing is left
    out)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    nodes = [a for a in flat if isinstance(a, fx.Node) and META_KEY in a.meta]
    floating = [a for a in nodes
                if info(a).outputs and all(t.dtype.is_floating_point for t in info(a).outputs)]
    if len(floating) == 1:
        return set(floating)
    i = named_loss(len(flat), getattr(gm, "_out_spec", None))
    if i is not None and flat[i] in floating:
        return {flat[i]}
    return set(floating)


def named_loss(outputs: int, spec: object) -> int | None:
    """Index, among a graph's ``outputs`` flat outputs, of the one the model's output
    structure ``spec`` (a pytree spec) names ``loss`` (a Hugging Face ``ModelOutput``, a
    dict); None when it names none."""
    if spec is None:
        return None
    try:
        i = pytree.tree_unflatten(list(range(outputs)), spec)["loss"]
    except (KeyError, TypeError, IndexError, ValueError):
        return None
    return i if isinstance(i, int) else None


def loss_output(gm: fx.GraphModule, spec: object) -> tuple[list, int | None]:
    """``gm``'s flat outputs and the index of the loss among them: the only output, or
    the one the output structure ``spec`` names ``loss`` (:func:`named_loss`); None
    when neither."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    return flat, 0 if len(flat) == 1 else named_loss(len(flat), spec)


def from_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values are computed from the call's inputs (its placeholders):
    what changes shape with the batch, where a parameter's value does not."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(u in out for u in n.all_input_nodes):
            out.add(n)
    return out


def requires_grad(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Node -> whether its value depends on a trainable parameter and is floating point
    (autograd records it), whatever is differentiated."""
    trainable = {n for n, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    needs: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        outs = info(n).outputs
        floating = bool(outs) and all(t.dtype.is_floating_point for t in outs)
        if n.op == "get_attr":
            needs[n] = n.target in trainable
        elif n.op in ("placeholder", "output"):
            needs[n] = False
        else:
            needs[n] = floating and any(needs.get(u, False) for u in n.all_input_nodes)
    return needs


def mark_gradients(gm: fx.GraphModule) -> None:
    """Set ``backward`` and ``returned_grad`` on every node's :class:`NodeInfo` (run
    after every node has one: :func:`autopar.capture.annotate.annotate` calls it last)."""
    needs = requires_grad(gm)
    roots = differentiated(gm)
    # the ancestors of the differentiated outputs: a gradient reaches a value only on a
    # path to one of them
    on_path: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in on_path:
            continue
        on_path.add(n)
        todo.extend(n.all_input_nodes)
    for n in gm.graph.nodes:
        ni = info(n)
        ni.backward = needs[n] and n in on_path
        ni.returned_grad = ni.backward and n in roots


def dual(u: fx.Node, v: fx.Node) -> bool:
    """Whether the edge from ``u`` into ``v`` carries a gradient back: both values
    receive one (``v``'s gradient flows into its floating inputs)."""
    return info(u).backward and info(v).backward


__all__ = ["differentiated", "dual", "from_inputs", "loss_output", "mark_gradients", "named_loss", "requires_grad"]
