"""ZeRO-1/2's gathers of the updated parameters in chunks, in forward order.

After the optimizer steps the shards, the whole parameters the graph reads are stale.
Without chunks :meth:`autopar.runtime.zero.Zero.refresh` gathers them all before the
forward.  With the plan's chunks (``Decisions.gather_chunks``, chosen by
:mod:`autopar.search.gathers`) the refresh only launches the first chunk's gather; the
graph calls :func:`zero_fetch` right before the first read of a chunk's parameters,
which waits for that chunk, copies it into the whole parameters, and launches the
next one.  One gather is in flight at a time, so the link sends the chunks in the
order the forward needs them and at most one chunk's gathered buffer is alive.

:func:`zero_fetch` returns the whole parameters themselves (leaves that accumulate
their gradients, as without chunks): a recomputation in backward, or a second copy
of the graph (multi-copy), calls it again and gets them as they are.  Every rank runs
the same graph, so every rank launches and waits for the same gathers in the same
order; anything read outside the forward (``state_dict``) first completes what is
left (:meth:`Chunks.settle`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.runtime.mesh import current
from autopar.runtime.zero3 import launch_gather
from autopar.runtime.zero_layout import Cut, unpack


def copy_out(fulls: list[torch.Tensor], cuts: list[Cut], gathered: torch.Tensor, d: int) -> None:
    """Copy each whole tensor out of a rank-major gathered buffer (rank ``r``'s flat
    padded buffers first, laid out by ``cuts``) into ``fulls``."""
    with torch.no_grad():
        for full, whole in zip(fulls, unpack(gathered, d, cuts)):
            full.copy_(whole)


def replace_reads(gm: fx.GraphModule, groups: list[list[str]],
                  call: Callable[[int, list[str], fx.Graph], fx.Node]) -> list[list[str]]:
    """Put one call per group of parameter targets right before the first use of any
    of them, and read each parameter from it (``operator.getitem`` of the call's
    result, in the group's order) instead of its ``get_attr``.  Groups are taken in the
    order of their first use (returned, without targets the graph never reads);
    ``call(i, targets, graph)`` makes the ``i``-th call at the graph's insertion point."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    reads: dict[str, list[fx.Node]] = {}
    for n in g.nodes:
        if n.op == "get_attr":
            reads.setdefault(n.target, []).append(n)
    groups = [[t for t in ts if t in reads] for ts in groups]

    def first_use(targets: list[str]) -> fx.Node:
        nodes = [u for t in targets for n in reads[t] for u in (n.users or [n])]
        return min(nodes, key=order.__getitem__)

    chain = sorted((ts for ts in groups if ts), key=lambda ts: order[first_use(ts)])
    for i, targets in enumerate(chain):
        meta = reads[targets[0]][0].meta
        with g.inserting_before(first_use(targets)):
            node = call(i, targets, g)
            for x in (*node.all_input_nodes, node):
                x.meta.update(meta)
            for j, t in enumerate(targets):
                full = g.call_function(operator.getitem, (node, j))
                full.meta.update(meta)
                for n in reads[t]:
                    n.replace_all_uses_with(full)
                    g.erase_node(n)
    g.lint()
    gm.recompile()
    return chain


@dataclass
class Chunks:
    """The chunks of one module's ZeRO-1/2 parameters: per chunk, the shards' flat
    padded buffers (what the optimizer steps, through its views), their layouts and the
    whole parameters the graph reads."""

    key: str
    axes: tuple[int, ...]
    shards: list[list[torch.Tensor]]
    cuts: list[list[Cut]]
    fulls: list[list[torch.Tensor]]
    _next: int = field(init=False)  # the next chunk to launch (len: none left this round)
    _done: int = field(init=False)  # chunks [0, _done) are gathered this round
    _flight: tuple[int, object, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._next = self._done = len(self.shards)  # no round yet: nothing to gather

    def start(self) -> None:
        """A new round (the shards changed): finish what an earlier round left, then
        launch the first chunk's gather."""
        self.settle()
        self._next = self._done = 0
        self._launch_next()

    def _launch_next(self) -> None:
        if self._flight is None and self._next < len(self.shards):
            work, out = launch_gather(self.shards[self._next], self.axes, async_op=True)
            self._flight = (self._next, work, out)
            self._next += 1

    def _finish_flight(self) -> None:
        k, work, out = self._flight
        self._flight = None
        work.wait()
        copy_out(self.fulls[k], self.cuts[k], out, current().size_of(self.axes))
        self._done = k + 1

    def fetch(self, k: int) -> tuple[torch.Tensor, ...]:
        """Chunk ``k``'s whole parameters, gathered (the chunks before it first, in
        order), with the next chunk's gather launched."""
        while self._done <= k:
            if self._flight is None:
                self._launch_next()
            self._finish_flight()
        self._launch_next()
        return tuple(self.fulls[k])

    def settle(self) -> None:
        """Gather every chunk left in this round, in order."""
        if self._done < len(self.shards):
            self.fetch(len(self.shards) - 1)


_CHUNKS: dict[str, Chunks] = {}
_KEYS = itertools.count()


def register(chunks: Chunks) -> None:
    """Make ``chunks`` known to the generated code's :func:`zero_fetch` calls."""
    _CHUNKS[chunks.key] = chunks


def new_key() -> str:
    """A key no other module's chunks use."""
    return f"zero_chunks.{next(_KEYS)}"


# run eagerly under torch.compile (a graph break per chunk): traced, dynamo would guard on
# the round's counters, which change every step, and compile the graph again each time
@torch.compiler.disable
def zero_fetch(key: str, k: int) -> tuple[torch.Tensor, ...]:
    """Chunk ``k`` of ``key``'s whole parameters, up to date (what the graph calls)."""
    return _CHUNKS[key].fetch(k)


__all__ = ["Chunks", "copy_out", "new_key", "register", "replace_reads", "zero_fetch"]
