"""Redistribution prices: what it costs to turn one placement of a tensor into another.

A redistribution in the forward has a dual collective of the same size in the backward,
so an edge's price counts both.  The steps of a pair come from
:func:`autopar.sharding.redistribute.plan_redistribution`; each collective is priced by
``autopar.cost_models`` (alpha-beta on the mesh's links).  Prices depend on the mesh
alone, so every :class:`~autopar.search.node_prices.CostModel` of one mesh shares them; whole edge
matrices are priced by numpy (:meth:`EdgePrices.redistribution_matrix`), bit-identical to
pricing pair by pair (docs/architecture.md, "Edge matrices priced by numpy").
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from autopar.capture.ir import TensorInfo
from autopar.cost_models import (
    MeshSpec,
    blocking_time,
    blocking_times,
)
from autopar.plans.placement import Placements
from autopar.sharding.redistribute import (
    RedistributionError,
    StepKind,
    placement_codes,
    plan_codes,
    step_shapes,
)


@dataclass
class MeshTables:
    """Caches that depend on the mesh alone, shared by its cost models: redistribution
    prices per (source, target, shape, dtype), each placement pair's step program, and
    collective times per (step kind, axis, bytes).  The steps themselves do not depend on
    the mesh: :func:`_code_steps` keeps them per process."""

    prices: dict = field(default_factory=dict)
    programs: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    # for whole edge matrices (CostModel.redistribution_matrix): each layout as an int
    # (a placement's hash is Python code: hashing pairs of them was most of the time)
    ids: dict = field(default_factory=dict)
    programs_np: _Programs = field(default_factory=lambda: _Programs())
    # whole edge matrices by (distinct sources, distinct targets, shape, dtype): shared by
    # every candidate the joint search plans on this mesh (a weight's edges have the same
    # shape at every micro-batch size: nearly half of a deep pipeline's matrices)
    matrices: dict = field(default_factory=dict)


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
        """The steps from layout id ``x`` to ``y`` (None: none exists)."""
        return _code_steps(self.layouts[x], self.layouts[y])

    def rows(self, ia: np.ndarray, ib: np.ndarray, nd: int, ids: int) -> np.ndarray:
        """Row of each (source, target) pair of ids (-1: not added yet)."""
        grid = self.grid.get(nd)
        if grid is None or grid.shape[0] < ids:
            # int32: a 4-axis mesh may meet ~1,300 layouts (a 2,600-square grid per rank)
            bigger = np.full((2 * ids, 2 * ids), -1, dtype=np.int32)
            if grid is not None:
                bigger[:grid.shape[0], :grid.shape[1]] = grid
            grid = self.grid[nd] = bigger
        return grid[np.ix_(ia, ib)]


_TABLES: OrderedDict[MeshSpec, MeshTables] = OrderedDict()
_TABLES_KEPT = 16  # meshes whose redistribution prices are kept (a joint search's sub-meshes: ~11 on 192x8)
_MATRICES_KEPT = 50_000  # edge matrices kept per mesh (~8x what the largest reference search uses)
_NO_PROGRAM = ()  # a pair no redistribution turns one into the other (S -> P)
# the steps that communicate, by the collective that prices them (slices and
# Replicate -> Partial are local: free)
_TALK = {StepKind.ALL_REDUCE: "all_reduce", StepKind.ALL_GATHER: "all_gather",
         StepKind.REDUCE_SCATTER: "reduce_scatter", StepKind.ALL_TO_ALL: "all_to_all"}


def mesh_tables(mesh: MeshSpec) -> MeshTables:
    """The shared caches of ``mesh``; the least recently used mesh's are dropped beyond
    :data:`_TABLES_KEPT`, so a long session does not grow."""
    if mesh in _TABLES:
        _TABLES.move_to_end(mesh)
    else:
        _TABLES[mesh] = MeshTables()
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return _TABLES[mesh]


def _program(src: Placements, dst: Placements, ndim: int, mesh_shape: tuple[int, ...],
             steps: list | None):
    """:func:`_program_codes` of two placements."""
    if steps is None:  # also a placement the planner has no code for: no program
        return _NO_PROGRAM
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


class EdgePrices:
    """Redistribution pricing of a :class:`~autopar.search.node_prices.CostModel` (its base class):
    needs ``self.mesh`` and ``self._tables`` (:func:`mesh_tables` of that mesh)."""

    mesh: MeshSpec
    _tables: MeshTables

    def redistribution(self, src: Placements, dst: Placements, t: TensorInfo,
                       dual: bool = True) -> float:
        """Seconds per step (forward + its backward dual) to turn ``src`` into ``dst``;
        ``inf`` when impossible.  ``dual=False``: the forward alone, where no gradient
        flows back (:func:`autopar.capture.grad_flow.dual`)."""
        key = (src, dst, t.shape, t.dtype)
        prices = self._tables.prices
        if key not in prices:
            prices[key] = 2.0 * self._redistribution_once(src, dst, t)
        return prices[key] if dual else 0.5 * prices[key]

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

    def matrix_tables(self) -> dict:
        """The mesh's whole edge matrices (:attr:`MeshTables.matrices`), for
        :func:`autopar.search.op_placement.edge_matrix`; emptied when it holds
        :data:`_MATRICES_KEPT` (a session that plans many models does not grow)."""
        m = self._tables.matrices
        if len(m) >= _MATRICES_KEPT:
            m.clear()
        return m

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
        # a redistribution blocks where it is issued (blocking_time)
        if kind is StepKind.ALL_GATHER:
            return blocking_times("all_gather", self.mesh, axis, b * self.mesh.shape[axis])
        return blocking_times(_TALK[kind], self.mesh, axis, b)

    def _steps(self, src: Placements, dst: Placements) -> list | None:
        """The steps from ``src`` to ``dst`` (:func:`_code_steps`, the cache the vectorized
        path shares); None: impossible, or a placement the planner has no code for."""
        try:
            return _code_steps(placement_codes(src), placement_codes(dst))
        except RedistributionError:
            return None

    def _collective(self, kind: StepKind, axis: int, b: float) -> float:
        """Seconds of one redistribution step moving ``b`` local bytes (memoized)."""
        key = (kind, axis, b)
        memo = self._tables.collectives
        if key not in memo:
            # a redistribution blocks where it is issued (blocking_time)
            if kind is StepKind.ALL_GATHER:
                memo[key] = blocking_time("all_gather", self.mesh, axis, b * self.mesh.shape[axis])
            elif kind in (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER, StepKind.ALL_TO_ALL):
                memo[key] = blocking_time(_TALK[kind], self.mesh, axis, b)
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


__all__ = ["EdgePrices", "MeshTables", "mesh_tables"]
