"""Price strategies and edges with ``autopar.cost_models`` (the search's inputs).

Forward compute is priced by the roofline and multiplied by ``1 + backward_factor``
(backward costs about twice the forward); a redistribution in the forward has a dual
collective of the same size in the backward, so edges count twice; parameter gradient
synchronisation is priced once per step.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from torch import fx

from autopar.annotate import VIEW_OPS
from autopar.cost_models import (
    MeshSpec,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_times,
    compute_time,
    optimizer_state_bytes,
    reduce_scatter_time,
    send_recv_time,
)
from autopar.ir import TensorInfo, info, tensor_inputs
from autopar.placement import (
    Placements,
    Shard,
    is_partial,
    is_replicate,
    local_shape,
    returned_placement,
)
from autopar.redistribute import (
    RedistributionError,
    StepKind,
    placement_codes,
    plan_codes,
    plan_redistribution,
    step_shapes,
)
from autopar.rules import OpStrategy
from autopar.rules.attention import SDPA, CPImpl, context_layout, sdpa_args, sdpa_placements
from autopar.runtime.experts import MOE_EXPERTS

aten = __import__("torch").ops.aten


@dataclass
class _MeshTables:
    """Caches that depend on the mesh alone, shared by its cost models: redistribution
    prices per (source, target, shape, dtype), each placement pair's steps and step
    program, and collective times per (step kind, axis, bytes)."""

    prices: dict = field(default_factory=dict)
    programs: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    # for whole edge matrices (CostModel.redistribution_matrix): each layout as an int
    # (a placement's hash is Python code: hashing pairs of them was most of the time)
    ids: dict = field(default_factory=dict)
    programs_np: _Programs = field(default_factory=lambda: _Programs())


_WIDTH = 8  # most communicating steps of one redistribution (two per mesh axis, <= 4 axes)
_DIMS = 8  # most tensor dims priced by the vectorized path (more: scalar pricing)


_CODE_STEPS: dict = {}
_CODE_STEPS_KEPT = 1 << 20  # pairs of placement codes kept (3 axes have ~50k)


def _code_steps(sc: tuple[int, ...], dc: tuple[int, ...]) -> list | None:
    """:func:`plan_codes` from ``sc`` to ``dc`` (None: none exists), planned once per
    process: steps do not depend on the axes' sizes, so every mesh with as many axes
    shares them (a joint search's stage sub-meshes)."""
    key = (sc, dc)
    steps = _CODE_STEPS.get(key, _CODE_STEPS)
    if steps is _CODE_STEPS:
        if len(_CODE_STEPS) >= _CODE_STEPS_KEPT:
            _CODE_STEPS.clear()
        try:
            steps = plan_codes(sc, dc)
        except RedistributionError:
            steps = None
        _CODE_STEPS[key] = steps
    return steps


@dataclass
class _Programs:
    """Every placement pair's program of one mesh as rows of numpy arrays: the
    communicating steps as (kind, axis) codes (-1: none) and element-count divisors,
    the per-dim divisors that make those exact (:func:`_program`), and whether any
    redistribution exists; ``grid[ndim]`` maps (source id, target id) to its row."""

    codes: np.ndarray = field(default_factory=lambda: np.full((1024, _WIDTH), -1, dtype=np.int64))
    divs: np.ndarray = field(default_factory=lambda: np.ones((1024, _WIDTH), dtype=np.int64))
    need: np.ndarray = field(default_factory=lambda: np.ones((1024, _DIMS), dtype=np.int64))
    possible: np.ndarray = field(default_factory=lambda: np.ones(1024, dtype=bool))
    size: int = 0
    kinds: dict = field(default_factory=dict)  # (StepKind, axis) -> code
    grid: dict = field(default_factory=dict)
    layouts: list = field(default_factory=list)  # each layout id's placement codes
    steps: dict = field(default_factory=dict)  # (source id, target id) -> steps or None
    uneven: dict = field(default_factory=dict)  # (row, shape, itemsize) -> seconds

    def add(self, prog, nd: int) -> int:
        """Append the program ``prog`` (:func:`_program`'s) of an ``nd``-dim pair."""
        if self.size == len(self.codes):  # grow by doubling: rows are added one by one
            self.codes = np.concatenate([self.codes, np.full_like(self.codes, -1)])
            self.divs = np.concatenate([self.divs, np.ones_like(self.divs)])
            self.need = np.concatenate([self.need, np.ones_like(self.need)])
            self.possible = np.concatenate([self.possible, np.ones_like(self.possible)])
        k = self.size
        self.size += 1
        if prog is _NO_PROGRAM:
            self.possible[k] = False
            return k
        steps, per_dim = prog
        talk = [(kind, axis, div) for kind, axis, div in steps if kind in _TALK]
        for j, (kind, axis, div) in enumerate(talk):
            self.codes[k, j] = self.kinds.setdefault((kind, axis), len(self.kinds))
            self.divs[k, j] = div
        self.need[k, :nd] = per_dim
        return k

    def plan(self, x: int, y: int) -> list | None:
        """The steps from layout id ``x`` to ``y`` (None: none exists), planned once."""
        key = (x, y)
        if key not in self.steps:
            self.steps[key] = _code_steps(self.layouts[x], self.layouts[y])
        return self.steps[key]


    def rows(self, ia: np.ndarray, ib: np.ndarray, nd: int, ids: int) -> np.ndarray:
        """Row of each (source, target) pair of ids (-1: not added yet)."""
        grid = self.grid.get(nd)
        if grid is None or grid.shape[0] < ids:
            bigger = np.full((2 * ids, 2 * ids), -1, dtype=np.int64)
            if grid is not None:
                bigger[:grid.shape[0], :grid.shape[1]] = grid
            grid = self.grid[nd] = bigger
        return grid[np.ix_(ia, ib)]


def op_dtype(node: fx.Node):
    """The dtype an op's kernel computes in: its output's (a matmul's inputs and output
    share it); the experts op's expert weights' (its output keeps the residual's)."""
    if node.target is MOE_EXPERTS:
        return info(node.args[3]).out.dtype
    ni = info(node)
    return ni.outputs[0].dtype if ni.outputs else None


def compute_floor(node: fx.Node, mesh: MeshSpec, backward_factor: float = 2.0) -> float:
    """Device-seconds below which no placement prices ``node``'s forward + backward
    compute: its FLOPs at the roofline's compute bound (the dtype's peak times
    ``flops_efficiency``).  :meth:`CostModel.op_time` divides the FLOPs by at most the
    devices that share the op and only adds (memory-bound time, launch floor, attention
    imbalance), so a layer spread over ``d`` devices takes at least ``floor / d``."""
    if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem:
        return 0.0
    flops = info(node).flops
    if not flops:
        return 0.0
    return flops / (mesh.peak_for(op_dtype(node)) * mesh.flops_efficiency) * (1.0 + backward_factor)


_TABLES: OrderedDict[MeshSpec, _MeshTables] = OrderedDict()
_TABLES_KEPT = 8  # meshes whose redistribution prices are kept (a joint search uses ~4)
_NO_PROGRAM = ()  # a pair no redistribution turns one into the other (S -> P)
# the steps that communicate, by the collective that prices them (slices and
# Replicate -> Partial are local: free)
_TALK = {StepKind.ALL_REDUCE: "all_reduce", StepKind.ALL_GATHER: "all_gather",
         StepKind.REDUCE_SCATTER: "reduce_scatter", StepKind.ALL_TO_ALL: "all_to_all"}


def _mesh_tables(mesh: MeshSpec) -> _MeshTables:
    """The shared caches of ``mesh``; the least recently used mesh's are dropped beyond
    :data:`_TABLES_KEPT`, so a long session does not grow."""
    if mesh in _TABLES:
        _TABLES.move_to_end(mesh)
    else:
        _TABLES[mesh] = _MeshTables()
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return _TABLES[mesh]


def _program(src: Placements, dst: Placements, ndim: int, mesh_shape: tuple[int, ...],
             steps: list | None):
    """:func:`_program_codes` of two placements."""
    return _program_codes(placement_codes(src), placement_codes(dst), ndim, mesh_shape, steps)


def _program_codes(sc: tuple[int, ...], dc: tuple[int, ...], ndim: int,
                   mesh_shape: tuple[int, ...], steps: list | None):
    """The steps turning ``src`` into ``dst`` for any tensor of ``ndim`` dims, each as
    (kind, axis, divisor of the global element count before it), plus, per dim, the
    product of the mesh axes that shard it in ``src`` or ``dst``: a tensor whose dims
    that product divides has every intermediate local shape exact (each state shards a
    dim by a subset of those axes), so the bytes before a step are numel // divisor.
    :data:`_NO_PROGRAM` when no redistribution exists (``steps`` None)."""
    if steps is None:
        return _NO_PROGRAM
    big = math.prod(mesh_shape)  # a dim every product of axis sizes divides
    local = [big] * ndim
    for a, d in enumerate(sc):
        if d >= 0:  # Shard(d)
            local[d] //= mesh_shape[a]
    shapes = step_shapes(steps, local, mesh_shape)
    whole = big ** ndim
    prog = tuple((s.kind, s.axis, whole // math.prod(before)) for s, before in zip(steps, shapes))
    need = [1] * ndim
    for a, n in enumerate(mesh_shape):
        for d in {c for c in (sc[a], dc[a]) if c >= 0}:
            need[d] *= n
    return prog, tuple(need)


@dataclass
class CostModel:
    """Prices for one mesh and optimizer; caches redistribution prices."""

    mesh: MeshSpec
    optimizer: str = "adamw"
    backward_factor: float = 2.0
    local_rows: int | None = None
    """The global batch when outputs are returned per data-parallel rank (``batch="local"``,
    :func:`autopar.placement.returned_placement`); None: outputs are returned replicated."""
    _tables: _MeshTables = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # redistribution prices depend on the mesh alone: every cost model of one mesh
        # (a joint search prices a shallow copy, then the full depth, then each
        # micro-batch size) shares them
        self._tables = _mesh_tables(self.mesh)

    # ------------------------------------------------------------ edges
    def redistribution(self, src: Placements, dst: Placements, t: TensorInfo) -> float:
        """Seconds per step (forward + its backward dual) to turn ``src`` into ``dst``;
        ``inf`` when impossible."""
        key = (src, dst, t.shape, t.dtype)
        prices = self._tables.prices
        if key not in prices:
            prices[key] = 2.0 * self._redistribution_once(src, dst, t)
        return prices[key]

    def output_redistribution(self, src: Placements, dst: Placements, t: TensorInfo) -> float:
        """Seconds per step to make a model output ``dst``: forward and backward dual,
        except for a scalar (the loss), whose backward needs no communication (every
        rank seeds the same gradient, passes/lower.py ``_scalar_outputs``)."""
        both = self.redistribution(src, dst, t)
        return both / 2.0 if not t.shape else both

    def output_cost(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step to return ``node``'s output (a model output) where the caller
        gets it (:func:`autopar.placement.returned_placement`)."""
        t = info(node).out
        dst = returned_placement(s.outputs[0], t.shape, self.local_rows)
        return self.output_redistribution(s.outputs[0], dst, t)

    def _redistribution_once(self, src: Placements, dst: Placements, t: TensorInfo) -> float:
        if src == dst:
            return 0.0
        # the steps depend on the placements alone: planned once per pair (and tensor
        # rank), then priced for each shape from the element count (tens of thousands of
        # shapes x pairs on a 3-axis mesh)
        shape = tuple(t.shape)
        programs = self._tables.programs
        pkey = (src, dst, len(shape))
        prog = programs.get(pkey)
        if prog is None:
            prog = programs[pkey] = _program(src, dst, len(shape), tuple(self.mesh.shape),
                                             self._steps(src, dst))
        if prog is _NO_PROGRAM:
            return math.inf
        steps, need = prog
        isz = t.nbytes / max(t.numel, 1)
        if any(d % k for d, k in zip(shape, need)):
            return self._uneven(src, dst, t, isz)
        numel = math.prod(shape)
        return sum(self._collective(kind, axis, (numel // div) * isz) for kind, axis, div in steps)

    def redistribution_matrix(self, us: tuple, ud: tuple, t: TensorInfo) -> np.ndarray:
        """:meth:`redistribution` from each of ``us`` to each of ``ud`` (distinct
        placements) for tensor ``t``, as a ``len(us) x len(ud)`` array, each entry equal
        to the scalar price exactly: every step's collective is priced for all pairs at
        once by numpy, with the scalar arithmetic in its order (3-axis meshes have ~140k
        such pairs per joint-search candidate)."""
        shape = tuple(t.shape)
        nd = len(shape)
        if nd > _DIMS or len(self.mesh.shape) * 2 > _WIDTH:
            return np.array([[self.redistribution(a, b, t) for b in ud] for a in us], dtype=np.float64)
        tb, pg = self._tables, self._tables.programs_np
        ia = np.array([self._layout_id(a) for a in us], dtype=np.intp)
        ib = np.array([self._layout_id(b) for b in ud], dtype=np.intp)
        idx = pg.rows(ia, ib, nd, len(tb.ids))
        mesh_shape = tuple(self.mesh.shape)
        for r, c in np.argwhere(idx < 0):  # pairs met for the first time: plan them
            x, y = int(ia[r]), int(ib[c])
            prog = ((), (1,) * nd) if x == y else \
                _program_codes(pg.layouts[x], pg.layouts[y], nd, mesh_shape, pg.plan(x, y))
            idx[r, c] = pg.grid[nd][x, y] = pg.add(prog, nd)
        idx = idx.ravel()
        all_codes, all_divs, all_need, all_possible = pg.codes, pg.divs, pg.need, pg.possible
        codes, divs = all_codes[idx], all_divs[idx]
        numel, isz = math.prod(shape), t.nbytes / max(t.numel, 1)
        total = np.zeros(len(idx))
        for s in range(_WIDTH):  # step by step, as the scalar sum adds them
            col_codes = codes[:, s]
            used = np.unique(col_codes)
            if used[-1] < 0:
                break  # no pair has this many steps
            col = np.zeros(len(idx))
            for c in used[used >= 0]:
                at = col_codes == c
                col[at] = self._collectives(int(c), (numel // divs[at, s]) * isz)
            total = total + col
        out = 2.0 * total
        out[~all_possible[idx]] = math.inf
        dims = np.ones(_DIMS, dtype=np.int64)
        dims[:nd] = shape
        uneven = np.flatnonzero(all_possible[idx] & (dims % all_need[idx] != 0).any(axis=1))
        for k in uneven:  # a dim some layout on the way does not split evenly: step by step
            key = (int(idx[k]), shape, isz)
            if key not in pg.uneven:
                x, y = int(ia[k // len(ud)]), int(ib[k % len(ud)])
                pg.uneven[key] = self._uneven_steps(pg.plan(x, y) or [], pg.layouts[x], shape, isz)
            out[k] = 2.0 * pg.uneven[key]
        return out.reshape(len(us), len(ud))

    def _layout_id(self, p: Placements) -> int:
        """The int standing for placements ``p`` in this mesh's tables."""
        ids = self._tables.ids
        x = ids.get(p)
        if x is None:
            x = ids[p] = len(ids)
            self._tables.programs_np.layouts.append(placement_codes(p))
        return x

    def _collectives(self, code: int, b: np.ndarray) -> np.ndarray:
        """:meth:`_collective` of the (kind, axis) ``code`` for every byte count in ``b``."""
        kind, axis = next(k for k, c in self._tables.programs_np.kinds.items() if c == code)
        if kind is StepKind.ALL_GATHER:
            return collective_times("all_gather", self.mesh, axis, b * self.mesh.shape[axis])
        return collective_times(_TALK[kind], self.mesh, axis, b)

    def _steps(self, src: Placements, dst: Placements) -> list | None:
        """:func:`plan_redistribution`'s steps, planned once per pair; None: impossible."""
        key = (src, dst)
        memo = self._tables.steps
        if key not in memo:
            try:
                memo[key] = plan_redistribution(src, dst)
            except ValueError:
                memo[key] = None
        return memo[key]

    def _collective(self, kind: StepKind, axis: int, b: float) -> float:
        """Seconds of one redistribution step moving ``b`` local bytes (memoized)."""
        key = (kind, axis, b)
        memo = self._tables.collectives
        if key not in memo:
            if kind is StepKind.ALL_REDUCE:
                memo[key] = all_reduce_time(self.mesh, axis, b)
            elif kind is StepKind.ALL_GATHER:
                memo[key] = all_gather_time(self.mesh, axis, b * self.mesh.shape[axis])
            elif kind is StepKind.REDUCE_SCATTER:
                memo[key] = reduce_scatter_time(self.mesh, axis, b)
            elif kind is StepKind.ALL_TO_ALL:
                memo[key] = all_to_all_time(self.mesh, axis, b)
            else:  # slices and Replicate -> Partial are local
                memo[key] = 0.0
        return memo[key]

    def _uneven(self, src: Placements, dst: Placements, t: TensorInfo, isz: float) -> float:
        """Price from the local shapes step by step (a dim some intermediate layout may
        not split evenly)."""
        return self._uneven_steps(self._steps(src, dst) or [], placement_codes(src), t.shape, isz)

    def _uneven_steps(self, steps: list, src: tuple[int, ...], shape: tuple, isz: float) -> float:
        """:meth:`_uneven` from the steps and the source's placement codes."""
        mesh_shape = self.mesh.shape
        local = list(shape)
        for a, d in enumerate(src):
            if d >= 0:  # Shard(d): a source layout the strategies chose divides its dims
                local[d] //= mesh_shape[a]
        shapes = step_shapes(steps, local, mesh_shape)
        return sum(self._collective(s.kind, s.axis, math.prod(before) * isz)
                   for s, before in zip(steps, shapes))

    # ------------------------------------------------------------ nodes
    def node_cost(self, node: fx.Node, s: OpStrategy) -> float:
        """Compute (forward + backward) plus the op's own communication."""
        if node.op == "get_attr" and info(node).param is not None:
            return self.grad_sync(s.outputs[0], info(node).out)
        return sum(self.op_time(node, s))

    def op_time(self, node: fx.Node, s: OpStrategy) -> tuple[float, float]:
        """(compute forward + backward, the op's own communication) of an op under
        strategy ``s``: the collectives its local form issues itself (context-parallel
        attention, expert dispatch, distributed cross-entropy), not those on its edges."""
        if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem:
            return 0.0, 0.0
        ni = info(node)
        div = 1
        for a, n in enumerate(self.mesh.shape):
            if any(isinstance(p[a], Shard) for p in (*s.inputs, *s.outputs)):
                div *= n
        local_bytes = sum(
            math.prod(local_shape(x.shape, p, self.mesh.shape)) * (x.nbytes / max(x.numel, 1))
            for x, p in zip([info(u).out for u in tensor_inputs(node)] + list(ni.outputs),
                            list(s.inputs) + list(s.outputs))
        )
        t = compute_time(self.mesh, ni.flops / div, local_bytes, op_dtype(node))
        if node.target is SDPA:
            t *= self.attention_compute_factor(node, s)
        return t * (1.0 + self.backward_factor), self.own_comm(node, s, t)

    def own_comm(self, node: fx.Node, s: OpStrategy, forward: float = 0.0) -> float:
        """Collectives an op issues inside its lowering (vocab-parallel cross-entropy,
        context-parallel attention).  A batch-sharded cross-entropy's token count is
        all-reduced asynchronously while the op's ``forward`` seconds compute
        (runtime/ops.py), at ``mesh.overlap`` of its speed: only what is left after
        them is exposed."""
        if node.target is SDPA:
            return self.attention_comm(node, s)
        if node.target is MOE_EXPERTS:
            return self.experts_comm(node, s)
        if node.target is not aten.cross_entropy_loss.default:
            return 0.0
        x = info(node.args[0]).out
        rows = math.prod(local_shape(x.shape, s.inputs[0], self.mesh.shape)[:1])
        total = 0.0
        for a, p in enumerate(s.inputs[0]):
            if isinstance(p, Shard) and p.dim == 1:
                total += 3 * all_reduce_time(self.mesh, a, rows * 4.0)
            elif isinstance(p, Shard) and p.dim == 0:
                total += max(0.0, all_reduce_time(self.mesh, a, 8.0) - forward * self.mesh.overlap)
        return total

    def _local_bytes(self, x: fx.Node, p: Placements) -> float:
        t = info(x).out
        return math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))

    def _ring(self, node: fx.Node, axes: tuple[int, ...]) -> tuple[int, bool]:
        """Ring size and whether ring attention of ``node`` over ``axes`` runs zigzag
        balanced (causal, each rank's chunk halves: ``ring_balanced``)."""
        from autopar.runtime.ring_attention import ring_balanced

        n = math.prod(self.mesh.shape[a] for a in axes)
        causal = sdpa_args(node).is_causal
        return n, causal and ring_balanced(info(node.args[0]).out.shape[2] // n)

    def attention_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step (forward + backward) of a context-parallel attention's own
        exchanges (:mod:`autopar.runtime.context`, :mod:`autopar.runtime.ring_attention`).

        Ulysses: per CP axis one all-to-all of q, k, v and the output in the forward,
        the reverse ones in the backward.  Ring: the busiest rank's point-to-point
        transfers of key/value blocks (``n - 1`` shifts, plus the zigzag re-layout when
        it runs), as many again for their gradients in the backward.
        """
        layout = context_layout(node, s.inputs, self.mesh.shape)
        if layout is None or layout.impl is None:
            return 0.0
        a = sdpa_args(node)
        qp, kp, vp, _ = sdpa_placements(node, s.inputs)
        q, k, v = (self._local_bytes(x, p) for x, p in ((a.q, qp), (a.k, kp), (a.v, vp)))
        o = self._local_bytes(node, s.outputs[0])
        if layout.impl is CPImpl.RING:
            from autopar.runtime.ring_attention import ring_attention_cost_factors

            n, balanced = self._ring(node, layout.cp_axes)
            _, transfers = ring_attention_cost_factors(n, a.is_causal, balanced)
            # the factor counts the zigzag re-layout in K/V blocks, true when q and the
            # output are as large as k and v; it moves half (2 ranks) or all of this
            # rank's q, k, v and output, so price it by their real sizes (GQA: q is larger)
            relayout = transfers - (n - 1)
            return 2.0 * ((n - 1) * send_recv_time(self.mesh, layout.cp_axes, k + v)
                          + relayout * send_recv_time(self.mesh, layout.cp_axes,
                                                      (q + k + v + o) / 2))
        return 2.0 * sum(all_to_all_time(self.mesh, ax, b)
                         for ax in layout.cp_axes for b in (q, k, v, o))

    def experts_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step of an expert-parallel experts op's own exchanges
        (:func:`autopar.runtime.experts.expert_parallel`): per expert-parallel axis the
        routed rows (``T_local * k`` of ``H`` elements) go out and come back by two
        all-to-alls in the forward and two in the backward, plus the small exchanges of
        counts and expert ids.  Routing is assumed even: the all-to-alls are priced at
        the mean rows per rank; a skewed router makes the busiest rank send and compute
        more than this says (no capacity limit caps it).  Experts split with tokens
        whole exchange nothing here (their Partial output is priced on its edge)."""
        from autopar.rules.experts import expert_axes

        ep, _ = expert_axes(s.inputs)
        if not ep:
            return 0.0
        hidden, index = info(node.args[0]).out, info(node.args[1]).out
        loc_h = local_shape(hidden.shape, s.inputs[0], self.mesh.shape)
        loc_i = local_shape(index.shape, s.inputs[1], self.mesh.shape)
        pairs = loc_i[0] * loc_i[1]
        weights = info(node.args[3]).out  # rows travel in the experts' dtype
        rows = pairs * loc_h[-1] * weights.nbytes / max(weights.numel, 1)
        n = self.mesh.shape[ep[0]]
        return (4.0 * all_to_all_time(self.mesh, ep[0], rows)
                + all_to_all_time(self.mesh, ep[0], pairs * 8.0)
                + all_to_all_time(self.mesh, ep[0], n * 8.0))

    def attention_compute_factor(self, node: fx.Node, s: OpStrategy) -> float:
        """The slowest rank's attention work against an even split of the priced FLOPs.

        Every attention is priced at its whole score matrix, causal or not (a fused
        causal kernel skips about half, for every strategy alike).  So the ring is
        charged only for its imbalance, not credited with the future blocks it skips:
        zigzag-balanced or non-causal it is even (1.0); causal with contiguous chunks the
        last rank does ``(2n-1)/(2n^2)`` of the causal work where an even split does
        ``1/(2n)``, ``(2n-1)/n`` times more.  (Crediting the skip made the planner pick
        ring attention on gloo where it measured 1.9x slower than data parallel:
        docs/benchmarks.md, context parallel.)  Causal query rows compute every block
        under an explicit mask: 2.0, twice a fused causal kernel's work."""
        layout = context_layout(node, s.inputs, self.mesh.shape)
        if layout is None or not sdpa_args(node).is_causal:
            return 1.0
        if layout.impl is None:
            # query rows: row_attention turns is_causal into an explicit mask, so every
            # score block is computed (and no fused causal kernel runs), twice what a
            # fused causal kernel does on the other splits
            return 2.0 if layout.row_axes else 1.0
        if layout.impl is not CPImpl.RING:
            return 1.0
        n, balanced = self._ring(node, layout.cp_axes)
        return 1.0 if balanced else (2 * n - 1) / n

    def grad_sync(self, p: Placements, t: TensorInfo) -> float:
        """All-reduce of a parameter's gradient over the axes it is replicated on."""
        axes = tuple(a for a, pa in enumerate(p) if is_replicate(pa) and self.mesh.shape[a] > 1)
        if not axes:
            return 0.0
        b = math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))
        # gradients are fused into buckets (runtime/grad_sync.py): the latency is paid
        # once per bucket, not per parameter, so a parameter pays only the bandwidth term
        return max(0.0, all_reduce_time(self.mesh, axes, b) - all_reduce_time(self.mesh, axes, 1.0))

    def node_memory(self, node: fx.Node, s: OpStrategy) -> float:
        """Bytes a strategy keeps per device: parameter + gradient + optimizer state
        for parameters; the output kept for backward for compute ops."""
        ni = info(node)
        if node.op == "get_attr":
            if ni.param is None:
                return float(ni.out.nbytes)
            b = math.prod(local_shape(ni.out.shape, s.outputs[0], self.mesh.shape)) * (
                ni.out.nbytes / max(ni.out.numel, 1))
            return 2.0 * b + optimizer_state_bytes(b, self.optimizer)
        if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem:
            return 0.0
        total = 0.0
        for t, p in zip(ni.outputs, s.outputs):
            total += math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))
        if node.target is aten.cross_entropy_loss.default:
            # cross-entropy keeps its log-probabilities (logits-sized) for backward
            x = info(node.args[0]).out
            total += math.prod(local_shape(x.shape, s.inputs[0], self.mesh.shape)) * (
                x.nbytes / max(x.numel, 1))
        return total


def param_state_split(node: fx.Node, p: Placements, mesh: MeshSpec, optimizer: str) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per device for a parameter placed ``p``."""
    t = info(node).out
    b = math.prod(local_shape(t.shape, p, mesh.shape)) * (t.nbytes / max(t.numel, 1))
    return b, b, optimizer_state_bytes(b, optimizer)


__all__ = ["CostModel", "is_partial", "param_state_split"]
