"""View, layout and indexing ops: a sharded dim moves to wherever the op puts it.

Each rule computes a map from input dim to output dim; a dim is shardable when it
survives the op whole (for reshape: it is the leading dim of a merged or split
group, so its chunks stay contiguous).  Partial passes through all of them (they are
linear).  The lowering rewrites literal shape arguments to local sizes.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg, info
from autopar.plans.placement import P, R, normalize_dim
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, ndim, register, shape

aten = torch.ops.aten


def dim_map_strategies(node: fx.Node, x: fx.Node, dim_map: dict[int, int]) -> list[AxisStrategy]:
    """``S(i)`` on input ``x`` gives ``S(dim_map[i])`` on every output; plus Partial."""
    nout = len(info(node).outputs)
    result = []
    for i, o in dim_map.items():
        s = assign(node, [(x, Shard(i))], [Shard(o)] * nout)
        if s is not None:
            result.append(s)
    s = assign(node, [(x, P)], [P] * nout)
    if s is not None:
        result.append(s)
    return result


def reshape_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim for a reshape: the first non-unit dim of each group of
    dims whose products match (so its shards stay contiguous in the output)."""
    result: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(src):
                    return result
                gi.append(i)
                pi *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return result
                gj.append(j)
                pj *= dst[j]
        fi = next((d for d in gi if src[d] != 1), None)
        fj = next((d for d in gj if dst[d] != 1), None)
        if fi is not None and fj is not None:
            result[fi] = fj
        i += 1
        j += 1
    return result


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.flatten.using_ints, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.unsqueeze.default, aten.view_as.default, aten.reshape_as.default)
def reshape_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Any reshape-like op, by the group analysis of :func:`reshape_dim_map`.

    ``squeeze`` runs on local shapes: a dim it names (all dims for ``squeeze()``) whose
    shard could be of size 1 would be dropped locally though kept globally, so such a
    dim shards only when it is larger than the whole mesh.  ``view_as``/``reshape_as``
    take the local shape of their second input, which is therefore sharded like the
    output.
    """
    x = node.args[0]
    xs = shape(x)
    dm = reshape_dim_map(xs, info(node).out.shape)
    t = node.target
    if t in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        n = len(xs)
        dims = arg(node, 1, "dim", list(range(n)))
        named = {normalize_dim(d, n) for d in ([dims] if isinstance(dims, int) else dims)}
        limit = math.prod(ctx.mesh_shape)
        dm = {i: o for i, o in dm.items() if i not in named or xs[i] > limit}
    if t in (aten.view_as.default, aten.reshape_as.default):
        other = node.args[1]
        result = [assign(node, [(x, Shard(i)), (other, Shard(o))], [Shard(o)])
                  for i, o in dm.items()]
        result.append(assign(node, [(x, P)], [P]))
        return [s for s in result if s is not None]
    return dim_map_strategies(node, x, dm)


@register(aten.transpose.int)
def transpose_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Swap two dims (a 0-d tensor has none: ``transpose(x, 0, -1)`` returns it)."""
    x = node.args[0]
    n = ndim(x)
    if n == 0:
        return dim_map_strategies(node, x, {})
    a, b = normalize_dim(node.args[1], n), normalize_dim(node.args[2], n)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return dim_map_strategies(node, x, {perm[o]: o for o in range(n)})


@register(aten.t.default)
def t_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """2-D transpose (a 1-D or 0-d tensor is returned as it is)."""
    x = node.args[0]
    return dim_map_strategies(node, x, {0: 1, 1: 0} if ndim(x) == 2 else {d: d for d in range(ndim(x))})


@register(aten.permute.default)
def permute_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """General permutation."""
    x = node.args[0]
    n = ndim(x)
    perm = [normalize_dim(d, n) for d in node.args[1]]
    return dim_map_strategies(node, x, {perm[o]: o for o in range(n)})


@register(aten.flip.default)
def flip_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``flip(x, dims)``: a dim that is not flipped keeps its shard; a flipped one stays
    whole (its shards would also swap ranks, which a local flip cannot do)."""
    x = node.args[0]
    n = ndim(x)
    flipped = {normalize_dim(d, n) for d in node.args[1]}
    return dim_map_strategies(node, x, {d: d for d in range(n) if d not in flipped})


@register(aten.roll.default)
def roll_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``roll(x, shifts, dims)``: a dim that is not rolled keeps its shard; a rolled one
    stays whole (elements cross shard boundaries).  No ``dims`` rolls the flattened
    tensor: every dim stays whole."""
    x = node.args[0]
    n = ndim(x)
    dims = arg(node, 2, "dims", [])
    rolled = {normalize_dim(d, n) for d in dims} if dims else set(range(n))
    return dim_map_strategies(node, x, {d: d for d in range(n) if d not in rolled})


@register(aten.expand.default)
def expand_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Dims that keep their size keep their shards; broadcast dims stay whole."""
    x = node.args[0]
    xs, os_ = shape(x), info(node).out.shape
    off = len(os_) - len(xs)
    return dim_map_strategies(node, x, {i: i + off for i in range(len(xs)) if xs[i] == os_[i + off]})


@register(aten.expand_as.default)
def expand_as_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``expand_as(x, other)`` reads only ``other``'s shape, so ``other`` is split like
    the output (the local op expands to the local shape): a dim of ``x`` that keeps its
    size shards alike; a broadcast dim shards ``other`` and the output with ``x`` whole."""
    x, other = node.args[0], node.args[1]
    xs, os_ = shape(x), info(node).out.shape
    off = len(os_) - len(xs)
    result = []
    for d in range(len(os_)):
        keeps = d >= off and xs[d - off] == os_[d]
        s = assign(node, [(x, Shard(d - off) if keeps else R), (other, Shard(d))], [Shard(d)])
        if s is not None:
            result.append(s)
    # a sum of booleans has no meaning: no Partial for them
    s = assign(node, [(x, P), (other, R)], [P]) if info(x).out.dtype is not torch.bool else None
    return [*result, *([s] if s is not None else [])]


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          aten.unbind.int)
def split_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim but the split dim; ``unbind`` also removes it."""
    x = node.args[0]
    n = ndim(x)
    if node.target is aten.unbind.int:
        d = normalize_dim(arg(node, 1, "dim", 0), n)
        return dim_map_strategies(node, x, {i: i - (i > d) for i in range(n) if i != d})
    d = normalize_dim(arg(node, 2, "dim", 0), n)
    return dim_map_strategies(node, x, {i: i for i in range(n) if i != d})


@register(aten.slice.Tensor)
def slice_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim but the sliced one (unless the slice takes the whole dim)."""
    x = node.args[0]
    n = ndim(x)
    d = normalize_dim(arg(node, 1, "dim", 0), n)
    whole = shape(x)[d] == info(node).out.shape[d] and arg(node, 4, "step", 1) == 1
    return dim_map_strategies(node, x, {i: i for i in range(n) if i != d or whole})


@register(aten.select.int)
def select_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim but the selected one, which disappears."""
    x = node.args[0]
    n = ndim(x)
    d = normalize_dim(node.args[1], n)
    return dim_map_strategies(node, x, {i: i - (i > d) for i in range(n) if i != d})


@register(aten.cat.default)
def cat_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """All inputs sharded alike on a dim other than the concatenated one.  ``cat``
    skips only 1-D empty inputs (shape ``(0,)``, torch's legacy rule); an empty input
    of full rank (``(0, 4)``) still needs its other dims to match, so it shards too."""
    xs = [x for x in node.args[0] if isinstance(x, fx.Node) and shape(x) != (0,)]
    n = info(node).out.ndim
    d = normalize_dim(arg(node, 1, "dim", 0), n)
    result = []
    for i in range(n):
        if i != d:
            s = assign(node, [(x, Shard(i)) for x in xs], [Shard(i)])
            if s is not None:
                result.append(s)
    s = assign(node, [(x, P) for x in xs], [P])
    if s is not None:
        result.append(s)
    return result


@register(aten.stack.default)
def stack_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """All inputs sharded alike; the new dim shifts later dims by one."""
    xs = list(node.args[0])
    n = info(node).out.ndim
    d = normalize_dim(arg(node, 1, "dim", 0), n)
    result = []
    for i in range(n - 1):
        s = assign(node, [(x, Shard(i)) for x in xs], [Shard(i + (i >= d))])
        if s is not None:
            result.append(s)
    s = assign(node, [(x, P) for x in xs], [P])
    if s is not None:
        result.append(s)
    return result


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Padding touches the last ``len(pad) // 2`` dims; the others shard through."""
    x = node.args[0]
    n = ndim(x)
    padded = len(node.args[1]) // 2
    return dim_map_strategies(node, x, {i: i for i in range(n - padded)})[:-1]  # no Partial: pad value


@register(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
          aten.new_empty.default)
def new_tensor_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``x.new_*(size)`` reads only x's dtype and device: x may have any placement and
    the output (a fresh global tensor) is replicated."""
    x = node.args[0]
    return [s for d in range(ndim(x)) for s in [assign(node, [(x, Shard(d))], [R])] if s is not None]
