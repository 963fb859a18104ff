"""Micro-batches weighted by their targets: a cross-entropy that averages over the
targets it does not ignore (``ignore_index``: padding, a prompt's tokens) gives the
whole batch's mean when each micro-batch's loss is weighted by its share of the
batch's targets, not by ``1 / M``.

One process on the whole batch divides the sum of every target's loss by the count of
targets over the batch; a micro-batch's graph divides its own sum by its own count.
Weighting micro-batch ``i``'s loss (and its backward's seed) by ``c_i / sum(c)`` gives
the same sum over the same count, exactly, whatever the padding; ``1 / M`` does only
when every micro-batch holds as many targets (gradient accumulation's usual error,
which the Hugging Face Trainer corrects with ``num_items_in_batch`` the same way).

The counts come before any forward, from a graph cut from the last stage's own: the
ops between the model's inputs and the loss's targets (the labels shifted and viewed),
and the count of those targets that are not ignored, summed over the ranks the rows
are split over, as the lowered loss counts them (:func:`autopar.runtime.ops.start_count`).
A cross-entropy summed and divided by a count the caller passes (Hugging Face's
``num_items_in_batch``, the batch's) weighs every micro-batch 1: each is already its part
of the batch's loss.  Any other loss (a mean over rows, class weights) keeps ``1 / M``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autopar.runtime import collectives as C
from autopar.runtime import ops as O
from autopar.runtime.pending import pending_sum

aten = torch.ops.aten

_SAME_LOSS = frozenset({C.all_reduce, C.scale_grad, pending_sum, aten._to_copy.default, aten.clone.default,
                        aten.alias.default, aten.view.default, aten.reshape.default})
"""Ops between a cross-entropy and the graph's output that keep it the loss, linearly
(the sum of a partial loss over the ranks, now or deferred; a gradient scale, a cast,
a view)."""


def target_count(target: torch.Tensor, ignore_index: int, row_axes: tuple[int, ...]) -> torch.Tensor:
    """The count of ``target``'s entries that are not ``ignore_index``, over ``row_axes``."""
    return O.start_count(target, ignore_index, row_axes)()


GIVEN_COUNT = "given"
"""What :func:`count_graph` returns for a loss that sums its targets and divides by a
count the caller passes (Hugging Face's ``num_items_in_batch``): every micro-batch's
loss is then its part of the batch's, weight 1."""


def _through(n: object) -> object:
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _SAME_LOSS:
        n = n.args[0]
    return n


@dataclass(frozen=True)
class LossTargets:
    """The cross-entropy a graph returns as its loss, averaging over its targets:
    ``target`` (the node), ``ignore`` (its ``ignore_index``), ``rows`` (the mesh axes
    its rows are split over: its count sums over them), and ``count``: the node the
    lowering hoisted that already sums the count over ``rows``, when there is one."""

    target: fx.Node
    ignore: int
    rows: tuple[int, ...]
    count: fx.Node | None = None


def _cross_entropy(n: object) -> tuple[LossTargets, int] | None:
    """(its targets, its reduction) for a cross-entropy without class weights over
    class-index targets, or None."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    if n.target is O.cross_entropy:
        x, target, ignore, reduction, rows = n.args[:5]
        count = n.args[6] if len(n.args) > 6 and isinstance(n.args[6], fx.Node) else None
        found = LossTargets(target, ignore, tuple(rows), count)
    elif n.target is aten.cross_entropy_loss.default:
        a = list(n.args) + [None] * 6
        weight = a[2] if a[2] is not None else n.kwargs.get("weight")
        reduction = a[3] if a[3] is not None else n.kwargs.get("reduction", 1)
        ignore = a[4] if a[4] is not None else n.kwargs.get("ignore_index", -100)
        if weight is not None:
            return None
        found = LossTargets(a[1], ignore, ())
    else:
        return None
    val = found.target.meta.get("val") if isinstance(found.target, fx.Node) else None
    if not isinstance(found.target, fx.Node) or (isinstance(val, torch.Tensor) and val.is_floating_point()):
        return None  # probability targets ignore nothing: their parts' means weigh alike
    return found, reduction


def _ancestors(n: fx.Node, allowed: set[fx.Node], gm: fx.GraphModule | None) -> set[fx.Node] | None:
    """The nodes ``n`` is computed from, when they read no graph input outside
    ``allowed`` and no parameter (with ``gm`` None, no attribute at all); else None."""
    need: set[fx.Node] = set()
    todo = [n]
    while todo:
        x = todo.pop()
        if x in need:
            continue
        need.add(x)
        if x.op == "placeholder" and x not in allowed:
            return None
        if x.op == "get_attr" and (gm is None or isinstance(getattr(gm, str(x.target), None),
                                                             torch.nn.Parameter)):
            return None
        todo.extend(x.all_input_nodes)
    return need


def loss_targets(gm: fx.GraphModule, allowed: set[fx.Node]) -> LossTargets | str | None:
    """:func:`targets_of` the loss ``gm`` returns as its last output."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return targets_of(flat[-1] if flat else None, allowed)


def targets_of(loss: object, allowed: set[fx.Node]) -> LossTargets | str | None:
    """The targets of the cross-entropy ``loss`` is (up to the ops of
    :data:`_SAME_LOSS`) when it averages over them; :data:`GIVEN_COUNT` when it is a
    sum divided by a count from the inputs in ``allowed``; else None."""
    n = _through(loss)
    if isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.div.Tensor:
        ce = _cross_entropy(_through(n.args[0]))
        count = n.args[1]  # a number, or computed from the inputs alone
        given = ce is not None and ce[1] == 2 and (
            not isinstance(count, fx.Node) or _ancestors(count, allowed, None) is not None)
        return GIVEN_COUNT if given else None
    ce = _cross_entropy(n)
    return ce[0] if ce is not None and ce[1] == 1 else None


@dataclass(frozen=True)
class TargetCounts:
    """What :class:`~autopar.runtime.pipeline.PipelineRunner` counts a micro-batch's
    targets with: ``graph`` (of the stage's model inputs) gives this rank's count, and
    the counts of every micro-batch are summed over ``rows`` in one all-reduce (the plan
    lists it: :mod:`autopar.search.step_collectives`)."""

    graph: fx.GraphModule
    rows: tuple[int, ...]

    def weights(self, inputs: list[list]) -> list[float] | None:
        """Each micro-batch's share of the batch's targets, from their inputs."""
        local = torch.stack([self.graph(*x).reshape(()) for x in inputs])
        return micro_weights(list(C.all_reduce_nograd(local, self.rows) if self.rows else local))


def count_graph(gm: fx.GraphModule, model_inputs: int) -> TargetCounts | str | None:
    """How a stage counts its loss's targets from its first ``model_inputs`` inputs
    (the model's, as the stage takes them); :data:`GIVEN_COUNT` for a sum over a count
    the caller gives; None when its loss is no cross-entropy over targets, or its
    targets need more than the model's inputs and constants (a received activation, a
    parameter)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    allowed = set(placeholders[:model_inputs])
    found = loss_targets(gm, allowed)
    if found is None or found is GIVEN_COUNT:
        return found
    need = _ancestors(found.target, allowed, gm)
    if need is None:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders[:model_inputs]:
        env[p] = g.node_copy(p)
    for n in gm.graph.nodes:
        if n in need and n.op != "placeholder":
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(g.call_function(target_count, (env[found.target], found.ignore, ())))
    return TargetCounts(fx.GraphModule(gm, g, class_name="TargetCount"), found.rows)


def waited(wait) -> torch.Tensor:
    """The value of a started all-reduce (:func:`autopar.runtime.ops.start_count`'s)."""
    return wait()


def weighted_loss(losses: tuple[torch.Tensor, ...], counts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The batch's loss from its parts' means and their counts of targets (the mean
    of the means where there are none: NaN either way)."""
    total = torch.stack([c.to(losses[0].dtype) for c in counts]).sum()
    if total <= 0:
        return torch.stack(losses).mean()
    return sum(loss * (c.to(loss.dtype) / total) for loss, c in zip(losses, counts))


def micro_weights(counts: list[torch.Tensor]) -> list[float] | None:
    """Each micro-batch's share of the batch's targets, or None when there are none
    (every target ignored: the loss is NaN either way, as in one process)."""
    c = [float(x) for x in counts]
    total = sum(c)
    return [x / total for x in c] if total > 0 else None


__all__ = ["GIVEN_COUNT", "LossTargets", "TargetCounts", "count_graph", "loss_targets", "micro_weights", "targets_of",
           "target_count", "waited", "weighted_loss"]
