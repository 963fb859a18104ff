"""A stage's backward in two parts for the zero-bubble schedule: ``B``, the gradients
of the stage's inputs (sent upstream at once), and ``W``, the gradients of its weights
(deferred by the schedule into what would be bubbles).

The split is ``torch.distributed.pipelining``'s own (``stage_backward_input`` and
``stage_backward_weight``, what its zero-bubble schedules run): ``B`` runs autograd
from the outputs to the inputs only, keeping the graph and recording the gradients
that reach the nodes where weight paths join the input paths; ``W`` runs autograd from
those nodes to the weights.  So ``W`` costs the weight-gradient work alone, not a
second backward.

Two cases that split would get wrong fall back to a plain ``W`` (autograd from the
outputs to the weights through the kept graph, after ``B`` took the input gradients):
a stage none of whose inputs carry a gradient (the first stage: there is nothing to
split at), and a stage with an output or a weight that no input reaches (its weight
gradients would not be recorded by ``B``).  :func:`splits_cleanly` decides, once per
stage graph (the structure is the same for every micro-batch).

``W`` writes ``.grad`` directly, so post-accumulate hooks (gradient bucketing) do not
see it: the runner reduces gradients after the step's last ``W`` instead
(:meth:`autopar.runtime.grad_sync.OrderedBuckets.flush`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining import _backward as tb


@dataclass
class Pending:
    """What ``W`` needs of a micro-batch after its ``B``."""

    weights: list[torch.Tensor]
    groups: list[dict] | None = None
    """torch's parameter groups (the split path), or None (the plain path)."""
    tensors: list[torch.Tensor] = field(default_factory=list)
    seeds: list[torch.Tensor] = field(default_factory=list)


def leaves(tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors whose gradients a backward from ``tensors`` accumulates (the
    stage's weights, whatever holds them: Parameters, ZeRO's whole tensors), ``inputs``
    left out, in a fixed traversal order."""
    skip = {id(t) for t in inputs}
    seen: set = set()
    out: list[torch.Tensor] = []
    todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node
        if var is not None and id(var) not in skip:
            out.append(var)
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    return out


def splits_cleanly(tensors: list[torch.Tensor], inputs: list[torch.Tensor],
                   weights: list[torch.Tensor]) -> bool:
    """True when every output depends on an input and every weight the outputs reach
    is in one of torch's parameter groups (see the module docstring)."""
    if not inputs:
        return False
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    if len(roots) != len(tensors):
        return False
    rev = tb.construct_reverse_graph(roots)
    in_fns = [f for f in (tb._get_grad_fn_or_grad_acc(t) for t in inputs) if f is not None]
    closure, _ = tb.reverse_closure(in_fns, set(), rev)
    if not all(r in closure for r in roots):
        return False
    w_fns = [tb._get_grad_fn_or_grad_acc(w) for w in weights]
    reached = set(rev) | set(roots)
    need = {f for f in w_fns if f in reached}
    groups = tb.get_param_groups(in_fns, [f for f in w_fns if f is not None], rev)
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    return need <= covered


def backward_input(tensors: list[torch.Tensor], seeds: list[torch.Tensor],
                   inputs: list[torch.Tensor], weights: list[torch.Tensor],
                   split: bool) -> Pending:
    """``B``: accumulate the inputs' gradients into their ``.grad``; return what ``W``
    needs.  ``split``: :func:`splits_cleanly` said so for this stage."""
    if split:
        # torch detaches the outputs in place afterwards, which views refuse: hand it a
        # copy of those (clone's backward passes the gradient through unchanged)
        outs = [t.clone() if t._is_view() else t for t in tensors]
        _, groups = tb.stage_backward_input(outs, seeds, inputs, iter(weights))
        return Pending(weights, groups)
    if inputs:
        grads = torch.autograd.grad(tensors, inputs, seeds, retain_graph=True, allow_unused=True)
        for t, g in zip(inputs, grads):
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g
    return Pending(weights, None, tensors, seeds)


def backward_weight(p: Pending) -> None:
    """``W``: accumulate the weights' gradients into their ``.grad`` (frees the graph)."""
    if p.groups is not None:
        tb.stage_backward_weight(iter(p.weights), p.groups)
    elif p.weights and p.tensors:
        torch.autograd.backward(p.tensors, p.seeds, inputs=p.weights)


__all__ = ["Pending", "backward_input", "backward_weight", "leaves", "splits_cleanly"]
