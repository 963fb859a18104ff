"""Forward values AND gradients of one rule strategy on simulated ranks.

API (what the OpInfo run and other rule tests import):

- :func:`check_strategy_grads` ``(node, strategy, mesh, inputs, seed=0, grads=True)``:
  raise ``AssertionError`` unless ``strategy`` computes the unsharded op's values and,
  for its floating outputs, the unsharded op's gradients.
- :func:`validate_node_grads` ``(node, mesh, inputs, grads=True) -> int``: the same for
  every strategy the registry offers ``node`` on ``mesh``; returns how many.

The backward follows the runtime's *dual placement* convention
(:mod:`autopar.runtime.collectives`): the gradient of a Replicate tensor is held as a
Partial sum, of ``Shard(d)`` as ``Shard(d)``, of Partial as Replicate.  So for a global
output gradient ``G`` (random) each rank is seeded with ``G`` scattered by the dual of the
output's placement (Shard: its chunk, Replicate: random summands, Partial: a copy), runs
``torch.autograd.grad`` through the local form (collectives inside it are autograd
functions whose backward runs on the rank's own thread), and each input's gradient is
assembled by the dual of its placement (Replicate: sum, Shard: concatenate, Partial:
every copy must agree) and compared with ``torch.autograd.grad`` of ``sum(out * G)`` on
the whole inputs in one process.  Integer and boolean inputs and outputs carry no
gradient and are skipped, as is the backward of an op none of whose outputs needs one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rule_sim import (
    Coord,
    as_list,
    assemble,
    assert_same,
    describe,
    local_form,
    mesh_coords,
    on_ranks,
    scatter,
    single_op,
)
from torch import fx
from torch.distributed.tensor import Partial, Replicate

from autopar.plans.placement import Placements
from autopar.sharding.rules import OpStrategy, RuleCtx, op_strategies


def dual(placements: Placements) -> Placements:
    """The placement a gradient is held in: Replicate <-> Partial, Shard(d) stays."""
    return tuple(Partial() if isinstance(p, Replicate) else Replicate() if isinstance(p, Partial)
                 else p for p in placements)


def differentiable(t: object) -> bool:
    """A tensor that can carry a gradient (floating or complex)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _leaf(t: torch.Tensor, grad: bool = True) -> torch.Tensor:
    x = t.detach().clone()
    return x.requires_grad_(True) if grad and differentiable(x) else x


@dataclass
class Reference:
    """The unsharded op on whole inputs: ``outs``; ``seeds``: a random gradient ``G``
    per output that needs one; ``grads``: each input's gradient of ``sum(out * G)``;
    ``mask``: which inputs take a gradient (floating, and accepted by the op)."""

    outs: list[object]
    seeds: dict[int, torch.Tensor]
    grads: list[torch.Tensor | None]
    mask: list[bool]


def _grads(outs: list[object], seeds: dict[int, torch.Tensor],
           leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """d(sum_j outs[j] * seeds[j]) / d leaves (None where a leaf takes no gradient)."""
    pairs = [(outs[j], g) for j, g in seeds.items()
             if isinstance(outs[j], torch.Tensor) and outs[j].requires_grad]
    want = [x for x in leaves if x.requires_grad]
    if not pairs or not want:
        return [None] * len(leaves)
    got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs],
                                   allow_unused=True))
    # a sparse gradient (embedding(sparse=True)) is compared by value
    got = (g.to_dense() if g is not None and g.layout != torch.strided else g for g in got)
    return [next(got) if x.requires_grad else None for x in leaves]


def _grad_mask(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> list[bool]:
    """Which floating inputs the op lets require a gradient (``nll_loss`` refuses its
    class weights): all of them, else each one tried alone."""
    mask = [differentiable(x) for x in inputs]
    try:
        with torch.enable_grad():
            gm(*[_leaf(x, m) for x, m in zip(inputs, mask)])
        return mask
    except RuntimeError:
        pass
    for i in [i for i, m in enumerate(mask) if m]:
        try:
            with torch.enable_grad():
                gm(*[_leaf(x, j == i) for j, x in enumerate(inputs)])
        except RuntimeError:
            mask[i] = False
    return mask


def reference(node: fx.Node, inputs: Sequence[torch.Tensor], seed: int = 0) -> Reference:
    """The unsharded op on whole ``inputs`` (:class:`Reference`)."""
    gm, _ = single_op(node)
    mask = _grad_mask(gm, inputs)
    leaves = [_leaf(x, m) for x, m in zip(inputs, mask)]
    with torch.enable_grad():
        outs = as_list(gm(*leaves))
    gen = torch.Generator().manual_seed(10_000 + seed)
    seeds = {j: torch.randn(o.shape, dtype=o.dtype, generator=gen)
             for j, o in enumerate(outs) if differentiable(o) and o.requires_grad}
    try:
        grads = _grads(outs, seeds, leaves)
    except RuntimeError:
        # torch's own backward rejects these inputs (scatter_add with a source larger
        # than its index): there is no gradient to compare with
        seeds, grads = {}, []
    outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
    return Reference(outs, seeds, grads, mask)


def check_strategy_grads(node: fx.Node, strategy: OpStrategy, mesh: Sequence[int],
                         inputs: Sequence[torch.Tensor], seed: int = 0, grads: bool = True,
                         shape_only: bool = False, ref: Reference | None = None) -> None:
    """Raise ``AssertionError`` unless ``strategy`` of ``node`` gives the unsharded op's
    outputs and (``grads``) input gradients.  ``shape_only`` compares shapes and dtypes
    only (``empty_like``), without gradients.  ``ref``: :func:`reference` of the inputs
    when the caller has it (it is the same for every strategy)."""
    what = describe(node, strategy, mesh)
    ref = ref if ref is not None else reference(node, inputs, seed)
    outs_ref, seeds, grads_ref = ref.outs, ref.seeds, ref.grads
    grads = grads and not shape_only and bool(seeds)
    gen = torch.Generator().manual_seed(seed)
    coords = mesh_coords(mesh)
    local_in: dict[Coord, list[torch.Tensor]] = {c: [] for c in coords}
    for x, p in zip(inputs, strategy.inputs, strict=True):
        for c, t in scatter(x, p, mesh, gen).items():
            local_in[c].append(t)
    local_seed: dict[Coord, dict[int, torch.Tensor]] = {c: {} for c in coords}
    for j, g in (seeds.items() if grads else ()):
        for c, t in scatter(g, dual(strategy.outputs[j]), mesh, gen).items():
            local_seed[c][j] = t
    gm = local_form(node, strategy, mesh)

    def body(c: Coord) -> tuple[list[object], list[torch.Tensor | None]]:
        leaves = [_leaf(x, m) if grads else x for x, m in zip(local_in[c], ref.mask)]
        with torch.set_grad_enabled(grads):
            outs = as_list(gm(*leaves))
            got = _grads(outs, local_seed[c], leaves) if grads else []
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], got

    results = on_ranks(body, mesh)
    assert all(len(r[0]) == len(outs_ref) for r in results.values()), \
        f"{what}: output count differs"
    for j, (expected, p) in enumerate(zip(outs_ref, strategy.outputs)):
        leaves = {c: results[c][0][j] for c in coords}
        if shape_only:
            leaves = {c: torch.zeros_like(t) for c, t in leaves.items()}
            expected = torch.zeros_like(expected)
        assert_same(assemble(leaves, p, mesh, f"{what}, output {j}"), expected,
                    f"{what}, output {j}")
    if not grads:
        return
    # a gradient is as precise as the least precise output it flows back through (a cast
    # to float32 rounds each Partial summand of G separately)
    coarse = max((outs_ref[j].dtype for j in seeds), key=lambda d: torch.finfo(d).eps)
    for i, (x, p, expected) in enumerate(zip(inputs, strategy.inputs, grads_ref)):
        if not ref.mask[i]:
            continue
        leaves = {c: _or_zeros(results[c][1][i], local_in[c][i]) for c in coords}
        expected = _or_zeros(expected, x)
        if torch.finfo(coarse).eps > torch.finfo(expected.dtype).eps:
            leaves = {c: t.to(coarse) for c, t in leaves.items()}
            expected = expected.to(coarse)
        # where the derivative is infinite (x / 0) the ranks' infinite pieces of a
        # Partial gradient add up to inf - inf: only the finite entries are compared
        finite = expected.isfinite()
        if not bool(finite.all()):
            keep = scatter(finite, tuple(Replicate() if isinstance(q, Partial) else q
                                         for q in dual(p)), mesh, gen)
            leaves = {c: t.masked_fill(~keep[c], 0) for c, t in leaves.items()}
            expected = expected.masked_fill(~finite, 0)
        got = assemble(leaves, dual(p), mesh, f"{what}, gradient of input {i}")
        assert_same(got, expected, f"{what}, gradient of input {i}")


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def validate_node_grads(node: fx.Node, mesh: Sequence[int], inputs: Sequence[torch.Tensor],
                        grads: bool = True, shape_only: bool = False) -> int:
    """Check every strategy the registry gives ``node`` on ``mesh`` (values and
    gradients); return how many."""
    strategies = op_strategies(node, RuleCtx(tuple(mesh)))
    ref = reference(node, inputs) if strategies else None
    for i, s in enumerate(strategies):
        check_strategy_grads(node, s, mesh, inputs, seed=i, grads=grads,
                             shape_only=shape_only, ref=ref)
    return len(strategies)


__all__ = ["Reference", "check_strategy_grads", "dual", "reference", "validate_node_grads"]
