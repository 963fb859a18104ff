"""Simulated ranks for the brute-force rule validator (DTensor's
``strategy_validation`` habit).

For one node of an annotated graph and one :class:`~autopar.sharding.rules.OpStrategy`:

1. cut the node out into a single-op graph (placeholders for its tensor inputs, in
   :func:`autopar.capture.ir.tensor_inputs` order) and run it on the global inputs: the reference;
2. cut it out again and apply :func:`autopar.passes.localize.localize` with a plan that
   holds exactly this strategy: the local form the real lowering produces;
3. split every global input into per-rank local inputs by its placements
   (``Shard``: the rank's chunk, ``Replicate``: a copy, ``Partial``: random summands
   that add up to the value);
4. run the local graph on every simulated rank, each in its own thread, with
   ``torch.distributed.all_reduce`` and ``autopar.runtime.mesh.current`` replaced by an
   in-memory process group that really sums (or maxes) across the threads;
5. assemble the global output from the output placements (``Shard``: concatenate,
   ``Replicate``: every rank's copy must agree, ``Partial``: sum) and compare with the
   reference.
"""

from __future__ import annotations

import collections
import itertools
import math
import queue
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from autopar.passes.localize import localize
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.runtime.collectives as C
import autopar.runtime.context as CP
import autopar.runtime.ops as O
import autopar.runtime.ring_attention as RA
from autopar.capture.ir import tensor_inputs
from autopar.plans.placement import Placements, fmt_placements
from autopar.sharding.rules import OpStrategy, RuleCtx, op_strategies

Coord = tuple[int, ...]

# Tolerances.  Inputs are fp64 with values of order one; a correct local form only
# reorders sums of at most a few hundred such terms, which moves the result by
# ~1e-14, while every wrong rule we have seen is off by >= 1e-2.  1e-9 keeps six
# orders of magnitude on both sides.  fp32 appears only where a sample casts
# (``_to_copy`` to float32): rounding each Partial summand separately costs ~1e-7.
# Half precision appears only in OpInfo's casts (``x.half()``, ``x.bfloat16()``): four
# summands of magnitude up to ~4 rounded separately (eps 1e-3 and 8e-3) cost up to
# ~8e-3 and ~6e-2.  Complex tensors take their real dtype's tolerance.
TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-1,
       torch.complex128: 1e-9, torch.complex64: 1e-5}

# A collective that not every rank of its group joins would hang: fail instead.
BARRIER_TIMEOUT_S = 10.0


def mesh_coords(mesh: Sequence[int]) -> list[Coord]:
    """Every coordinate of the mesh, row-major (the rank order)."""
    return list(itertools.product(*[range(n) for n in mesh]))


# ---------------------------------------------------------------- graphs
def node_values(gm: fx.GraphModule, inputs: Sequence[object]) -> dict[str, object]:
    """Every node's value when ``gm`` runs on ``inputs`` (by node name)."""
    env: dict[str, object] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            env[n.name] = out
            return out

    with torch.no_grad():
        _Recorder(gm).run(*inputs)
    return env


def single_op(node: fx.Node) -> tuple[fx.GraphModule, str]:
    """A graph holding only ``node``, its tensor inputs turned into placeholders."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in tensor_inputs(node):
        p = g.placeholder(x.name)
        p.meta = dict(x.meta)
        env[x] = p
    new = g.node_copy(node, lambda n: env[n])
    g.output(new)
    return fx.GraphModule(torch.nn.Module(), g), new.name


def local_form(node: fx.Node, strategy: OpStrategy, mesh: Sequence[int]) -> fx.GraphModule:
    """The single-op graph of ``node`` as the lowering localizes it for ``strategy``."""
    gm, name = single_op(node)
    plan = SimpleNamespace(
        mesh=SimpleNamespace(shape=tuple(mesh)),
        decisions=SimpleNamespace(pipeline_stages=1),
        nodes={name: SimpleNamespace(
            in_placements=[fmt_placements(p) for p in strategy.inputs],
            out_placements=[fmt_placements(p) for p in strategy.outputs],
        )},
    )
    localize(gm, plan)
    gm.recompile()
    return gm


def as_list(out: object) -> list[torch.Tensor]:
    """An op's result as a list of tensors."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


# ---------------------------------------------------------------- placements
def _summands(t: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if t.dtype == torch.bool:
        raise AssertionError("a Partial boolean tensor has no meaning")
    if t.is_floating_point() or t.is_complex():
        parts = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for _ in range(n - 1)]
    else:
        parts = [torch.randint(-3, 4, t.shape, dtype=t.dtype, generator=gen) for _ in range(n - 1)]
    return [*parts, t - sum(parts, torch.zeros_like(t))]


def scatter(value: torch.Tensor, placements: Placements, mesh: Sequence[int],
            gen: torch.Generator) -> dict[Coord, torch.Tensor]:
    """Each coordinate's local tensor (earlier mesh axes shard first)."""
    parts: dict[Coord, torch.Tensor] = {(): value}
    for p, n in zip(placements, mesh):
        nxt: dict[Coord, torch.Tensor] = {}
        for pre, t in parts.items():
            pieces = _summands(t, n, gen) if isinstance(p, Partial) else None
            for c in range(n):
                if isinstance(p, Shard):
                    size = t.shape[p.dim] // n
                    nxt[(*pre, c)] = t.narrow(p.dim, c * size, size).contiguous()
                elif isinstance(p, Partial):
                    nxt[(*pre, c)] = pieces[c]
                else:
                    nxt[(*pre, c)] = t.clone()
        parts = nxt
    return parts


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to :data:`TOL` (floats, complex) or exactly (integers, booleans); NaN
    equals NaN (``pow`` of a negative base, a median over nothing)."""
    if expected.is_floating_point() or expected.is_complex():
        tol = TOL[expected.dtype]
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    else:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
            f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
        assert torch.equal(actual, expected), f"{what}: values differ"


def assemble(leaves: dict[Coord, torch.Tensor], placements: Placements, mesh: Sequence[int],
             what: str) -> torch.Tensor:
    """Inverse of :func:`scatter`: the global value the ranks' locals stand for."""
    parts = leaves
    for a in reversed(range(len(mesh))):
        p, n = placements[a], mesh[a]
        nxt: dict[Coord, torch.Tensor] = {}
        for pre in {k[:a] for k in parts}:
            pieces = [parts[(*pre, c)] for c in range(n)]
            if isinstance(p, Shard):
                nxt[pre] = torch.cat(pieces, dim=p.dim)
            elif isinstance(p, Partial):
                nxt[pre] = sum(pieces[1:], pieces[0])
            else:
                assert isinstance(p, Replicate)
                for c, piece in enumerate(pieces[1:], 1):
                    assert_same(piece, pieces[0],
                                f"{what}: replicated copies differ on mesh axis {a} "
                                f"(coordinate {c} vs 0 under {pre})")
                nxt[pre] = pieces[0]
        parts = nxt
    return parts[()]


# ---------------------------------------------------------------- simulated world
class _Group:
    """The ranks that differ only along some mesh axes (one, or several for
    ``group_of``); a rank's place in it is row-major over those axes."""

    def __init__(self, axes: tuple[int, ...], mesh: tuple[int, ...]) -> None:
        self.axes, self.mesh = axes, mesh
        self.n = math.prod(mesh[a] for a in axes)
        self.barrier = threading.Barrier(self.n, timeout=BARRIER_TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * self.n
        self.ops: list[object] = [None] * self.n

    def rank(self, coord: Coord) -> int:
        """The place of the rank at ``coord`` in this group."""
        r = 0
        for a in self.axes:
            r = r * self.mesh[a] + coord[a]
        return r


class _SimMesh:
    """What :func:`autopar.runtime.mesh.current` returns on a simulated rank."""

    def __init__(self, shape: tuple[int, ...], coord: Coord, groups: dict) -> None:
        self.shape, self.coord, self._groups = shape, coord, groups

    def group(self, axis: int) -> _Group:
        return self.group_of((axis,))

    def group_of(self, axes: tuple[int, ...]) -> _Group:
        axes = tuple(sorted(axes))
        return self._groups[(axes, tuple(c for a, c in enumerate(self.coord) if a not in axes))]


_TLS = threading.local()


def _current() -> _SimMesh:
    m = getattr(_TLS, "mesh", None)
    if m is None:
        raise RuntimeError("collective called outside a simulated rank")
    return m


def _all_reduce(tensor: torch.Tensor, op: object = dist.ReduceOp.SUM, group: object = None,
                async_op: bool = False) -> _DoneWork | None:
    """In-memory all-reduce across the simulated ranks of ``group`` (in place).  An
    async call completes before it returns (the ranks are threads meeting at a
    barrier) and hands back a work handle whose wait is a no-op."""
    assert isinstance(group, _Group), f"all_reduce needs a mesh-axis group, got {group!r}"
    r = group.rank(_current().coord)
    group.slots[r] = tensor.detach().clone()
    group.ops[r] = op
    group.barrier.wait()
    if any(o != group.ops[0] for o in group.ops):
        raise AssertionError(f"ranks disagree on the reduce op: {group.ops}")
    stacked = torch.stack(group.slots)
    if op == dist.ReduceOp.SUM:
        result = stacked.sum(0)
    elif op == dist.ReduceOp.MAX:
        result = stacked.amax(0)
    else:
        raise AssertionError(f"reduce op {op} not simulated")
    group.barrier.wait()  # nobody refills the slots before every rank has read them
    with torch.no_grad():
        tensor.copy_(result)
    return _DoneWork() if async_op else None


def _all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                       input_split_sizes=None, group: object = None,
                       async_op: bool = False) -> _DoneWork | None:
    """In-memory all-to-all: rank ``r``'s output chunk ``j`` is rank ``j``'s input chunk
    ``r``; equal chunks (what ``autopar.runtime.collectives.all_to_all`` sends) or, with
    split sizes, uneven ones along dim 0 (``autopar.runtime.experts``), whose output
    sizes must match what the senders send."""
    assert isinstance(group, _Group), f"all_to_all_single needs a mesh-axis group, got {group!r}"
    assert (output_split_sizes is None) == (input_split_sizes is None), "one-sided split sizes"
    r = group.rank(_current().coord)
    group.slots[r] = input.detach().clone()
    group.ops[r] = None if input_split_sizes is None else list(input_split_sizes)
    group.barrier.wait()
    if input_split_sizes is None:
        mine = torch.cat([group.slots[j].chunk(group.n)[r] for j in range(group.n)])
    else:
        got = [group.slots[j].split(group.ops[j])[r] for j in range(group.n)]
        assert [int(g.shape[0]) for g in got] == list(output_split_sizes), \
            f"rank {r} expects {list(output_split_sizes)} rows, is sent {[g.shape[0] for g in got]}"
        mine = torch.cat(got)
    group.barrier.wait()
    with torch.no_grad():
        output.copy_(mine)
    return _DoneWork() if async_op else None


def _exchange(group: _Group, mine: object) -> list:
    """Every rank of ``group`` posts ``mine``; each gets the list of all posts (rank order)."""
    r = group.rank(_current().coord)
    group.slots[r] = mine
    group.barrier.wait()
    got = list(group.slots)
    group.barrier.wait()  # nobody refills the slots before every rank has read them
    return got


def _all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group: object = None,
                async_op: bool = False) -> _DoneWork | None:
    """In-memory all-gather: ``parts[j]`` becomes rank ``j``'s tensor."""
    assert isinstance(group, _Group), f"all_gather needs a mesh-axis group, got {group!r}"
    got = _exchange(group, tensor.detach().clone())
    with torch.no_grad():
        for out, t in zip(parts, got, strict=True):
            out.copy_(t)
    return _DoneWork() if async_op else None


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: object = dist.ReduceOp.SUM,
                    group: object = None, async_op: bool = False) -> _DoneWork | None:
    """In-memory reduce-scatter of flat tensors: rank ``r`` gets chunk ``r`` of the sum."""
    assert isinstance(group, _Group), f"reduce_scatter needs a mesh-axis group, got {group!r}"
    assert op == dist.ReduceOp.SUM, f"reduce op {op} not simulated"
    got = _exchange(group, input.detach().clone())
    total = torch.stack(got).sum(0)
    with torch.no_grad():
        output.copy_(total.chunk(group.n)[group.rank(_current().coord)].view_as(output))
    return _DoneWork() if async_op else None


class _SimRing:
    """What :func:`autopar.runtime.ring_attention.ring_of` returns on a simulated rank:
    point-to-point messages through queues keyed by (ring, source, destination, tag)."""

    def __init__(self, boxes: dict, ring: tuple, size: int, pos: int) -> None:
        self.boxes, self.ring, self.size, self.pos = boxes, ring, size, pos

    def exchange(self, sends, recvs) -> None:
        """Post every send, then take every receive (a missing message fails, not hangs)."""
        for t, p, tag in sends:
            self.boxes[(self.ring, self.pos, p, tag)].put(t.detach().clone())
        for t, p, tag in recvs:
            t.copy_(self.boxes[(self.ring, p, self.pos, tag)].get(timeout=BARRIER_TIMEOUT_S))


def _ring_of(boxes: dict):
    def ring_of(axes: tuple[int, ...]) -> _SimRing:
        m = _current()
        pos, size = 0, 1
        for a in axes:
            pos, size = pos * m.shape[a] + m.coord[a], size * m.shape[a]
        others = tuple(c for a, c in enumerate(m.coord) if a not in axes)
        return _SimRing(boxes, (tuple(axes), others), size, pos)
    return ring_of


class _DoneWork:
    """The handle of a simulated async collective, already complete."""

    def wait(self) -> bool:
        """Nothing to wait for: the simulated collective finished when it was issued."""
        return True


def on_ranks(body: Callable[[Coord], object], mesh: Sequence[int]) -> dict[Coord, object]:
    """Call ``body(coord)`` on every simulated rank, one thread each, with the
    collectives patched to meet in memory; returns each rank's result.  Autograd's
    backward of CPU tensors runs on the calling thread, so a ``body`` that also runs
    backward issues its collectives (autograd functions of
    :mod:`autopar.runtime.collectives`) from its own rank's thread too."""
    mesh = tuple(mesh)
    coords = mesh_coords(mesh)
    # a group per set of axes (and coordinate on the others): group_of spans several
    subsets = [tuple(a for a in range(len(mesh)) if m >> a & 1) for m in range(1, 2 ** len(mesh))]
    groups = {(ax, tuple(x for a, x in enumerate(c) if a not in ax)): None
              for ax in subsets for c in coords}
    groups = {k: _Group(k[0], mesh) for k in groups}
    results: dict[Coord, object] = {}
    errors: list[BaseException] = []

    def work(c: Coord) -> None:
        _TLS.mesh = _SimMesh(mesh, c, groups)
        try:
            results[c] = body(c)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            for g in groups.values():
                g.barrier.abort()
        finally:
            _TLS.mesh = None

    with mock.patch.object(dist, "all_reduce", _all_reduce), \
            mock.patch.object(dist, "all_gather", _all_gather), \
            mock.patch.object(dist, "reduce_scatter_tensor", _reduce_scatter), \
            mock.patch.object(dist, "reduce_scatter_single", _reduce_scatter, create=True), \
            mock.patch.object(dist, "all_to_all_single", _all_to_all_single), \
            mock.patch.object(C, "current", _current), \
            mock.patch.object(CP, "current", _current), \
            mock.patch.object(RA, "ring_of", _ring_of(collections.defaultdict(queue.Queue))), \
            mock.patch.object(O, "current", _current):
        threads = [threading.Thread(target=work, args=(c,)) for c in coords]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        # the first rank to fail, not a rank whose barrier that failure broke
        errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
        raise errors[0]
    return results


def run_ranks(gm: fx.GraphModule, local_inputs: dict[Coord, list[torch.Tensor]],
              mesh: Sequence[int]) -> dict[Coord, list[torch.Tensor]]:
    """Run ``gm`` on every simulated rank, one thread each, communicating in memory."""
    def body(c: Coord) -> list[torch.Tensor]:
        with torch.no_grad():
            return as_list(gm(*local_inputs[c]))
    return on_ranks(body, mesh)


# ---------------------------------------------------------------- the check
def describe(node: fx.Node, strategy: OpStrategy, mesh: Sequence[int]) -> str:
    """``aten.op on mesh (2, 2): [S(0)R, RR] -> [S(0)P]``."""
    ins = ", ".join(fmt_placements(p) for p in strategy.inputs)
    outs = ", ".join(fmt_placements(p) for p in strategy.outputs)
    return f"{node.target} ({node.name}) on mesh {tuple(mesh)}: [{ins}] -> [{outs}]"


def check_strategy(node: fx.Node, strategy: OpStrategy, mesh: Sequence[int],
                   inputs: Sequence[torch.Tensor], seed: int = 0,
                   shape_only: bool = False, ref: list[torch.Tensor] | None = None) -> None:
    """Raise ``AssertionError`` unless ``strategy`` of ``node`` computes the unsharded op.

    ``shape_only`` compares shapes and dtypes only (for ops whose values are undefined,
    like ``empty_like``).  ``ref``: the unsharded op's outputs on ``inputs`` when the
    caller has them (:func:`validate_node` computes them once for all strategies).
    """
    what = describe(node, strategy, mesh)
    if ref is None:
        ref = unsharded(node, inputs)
    gen = torch.Generator().manual_seed(seed)
    coords = mesh_coords(mesh)
    local_inputs: dict[Coord, list[torch.Tensor]] = {c: [] for c in coords}
    for x, p in zip(inputs, strategy.inputs):
        for c, t in scatter(x, p, mesh, gen).items():
            local_inputs[c].append(t)
    results = run_ranks(local_form(node, strategy, mesh), local_inputs, mesh)
    assert all(len(r) == len(ref) for r in results.values()), f"{what}: output count differs"
    for j, (expected, p) in enumerate(zip(ref, strategy.outputs)):
        leaves = {c: results[c][j] for c in coords}
        if shape_only:
            leaves = {c: torch.zeros_like(t) for c, t in leaves.items()}
            expected = torch.zeros_like(expected)
        got = assemble(leaves, p, mesh, f"{what}, output {j}")
        assert_same(got, expected, f"{what}, output {j}")


def unsharded(node: fx.Node, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``node``'s op on whole ``inputs``, in one process: what every strategy must give."""
    ref_gm, _ = single_op(node)
    with torch.no_grad():
        return as_list(ref_gm(*inputs))


def validate_node(node: fx.Node, mesh: Sequence[int], inputs: Sequence[torch.Tensor],
                  shape_only: bool = False) -> int:
    """Check every strategy the registry gives ``node`` on ``mesh``; return how many."""
    strategies = op_strategies(node, RuleCtx(tuple(mesh)))
    ref = unsharded(node, inputs) if strategies else None
    for i, s in enumerate(strategies):
        check_strategy(node, s, mesh, inputs, seed=i, shape_only=shape_only, ref=ref)
    return len(strategies)
