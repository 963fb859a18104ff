"""Pipeline-parallel training step for one rank (and gradient accumulation, its
one-stage case).

:class:`PipelineRunner` runs this rank's
:class:`~autopar.runtime.stage_graph.StageGraph` (one, or ``v`` model chunks under the
interleaved schedule) over ``M`` micro-batches of the global batch in the order
:func:`autopar.plans.schedules.actions` gives: GPipe, 1F1B, interleaved 1F1B or zero-bubble
(see there; zero-bubble's backward is split by :mod:`autopar.runtime.split_backward`).

A forward ``F(k, i)`` of virtual stage ``k`` receives the boundary activations of
micro-batch ``i`` from virtual stage ``k-1``, runs the stage graph and sends its boundary
values to ``k+1``; a backward ``B(k, i)`` receives their gradients from ``k+1``, runs
autograd and sends the gradients of the received activations to ``k-1``.  Virtual stage
``k`` runs on pipeline rank ``k % p``; peers are ``current().stage_rank(...)``, the rank
with the same sub-mesh coordinate in that stage, on the default process group
(``isend``/``irecv``, gloo or nccl).

**Why it cannot deadlock, and how messages match.** Sends are non-blocking (``isend``,
waited at the end of the step), so a rank only ever blocks on a receive.  Every
schedule is a topological order of the dependencies (:mod:`autopar.plans.schedules`, checked
by ``list_schedule`` in the tests), so every awaited message is eventually sent.
Matching is by order on each directed rank pair, which both backends guarantee for
one (src, dst, tag): the receiver computes the sender's own action order (every rank
knows every rank's schedule) and posts its receives in exactly the order the sender
sends, lazily: when an action needs a message, the receives of that link up to it are
posted, then it waits.  Under 1F1B two neighbours' messages arrive in the order they
are needed; under the interleaved schedule a rank pair carries activations and
gradients of several chunks, and a message may be posted before one needed earlier.
Collectives inside a stage (tensor parallelism, gradient sync) use the stage's sub-mesh
groups, whose ranks all run the same schedule, so they are issued in the same order.

**Boundary shapes** are exchanged once: the first activation message into each virtual
stage is preceded by a small int64 header per value (dtype, requires-grad, shape); both
sides cache it.  Micro-batches all have the same shape, so later steps skip it.  This
stays right for values inserted by lowering (collective outputs), whose local shapes
are in no graph metadata.

**Loss.** The last virtual stage's graph output must be one scalar per micro-batch: the
model's loss, a *mean* over the micro-batch (already scaled for the sub-mesh by
``scale_grad``).  Each micro-batch's backward is seeded with its weight: ``1/M`` (the
mean of the micro-batch means: the batch's mean for equal micro-batches), or for a
cross-entropy over targets some of which are ignored (padding), its share of the
batch's targets, counted before the step (:mod:`autopar.runtime.token_weights`), so
the gradients are those of the whole batch's token mean however the padding falls.
The step returns the weighted sum of the micro-batch losses, broadcast from the last
stage over the pipeline axis.

**Gradient sync.** An optional ``grad_sync`` (a :class:`Toggle`, e.g.
:class:`~autopar.runtime.grad_sync.GradSync`) is disabled for every backward except
this rank's last one (zero-bubble: for every one, then flushed after the last ``W``), so data-parallel all-reduces run once per step on the fully
accumulated gradients (they would otherwise add every partial gradient again on each
backward); every chunk's gradients are complete by then.  Its previous ``enabled``
value is restored after the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from autopar.plans.kinds import Schedule
from autopar.plans.schedules import actions, virtual_stage
from autopar.runtime.compile_fallback import CompiledOrEager
from autopar.runtime.mesh import current
from autopar.runtime.split_backward import (
    Pending,
    backward_input,
    backward_weight,
    leaves,
    splits_cleanly,
)
from autopar.runtime.stage_graph import StageGraph
from autopar.runtime.stage_wire import HEADER, BoundarySlices, Meta, decode, encode, wire
from autopar.runtime.tls import issue
from autopar.runtime.token_weights import GIVEN_COUNT, count_graph


class Toggle(Protocol):
    """What the runner needs of a gradient synchroniser: an on/off switch, and a
    ``flush`` that reduces every gradient now (after the zero-bubble schedule's last
    ``W``, which writes gradients without running hooks)."""

    enabled: bool

    def flush(self) -> None:
        """Reduce every gradient now."""


@dataclass
class _MicroBatch:
    """What a forward keeps for its backward."""

    received: list[torch.Tensor] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    pending: Pending | None = None  # zero-bubble: what W needs after B


class PipelineRunner:
    """Runs training steps of one rank's pipeline stage (or interleaved chunks).

    ``stage``: this rank's stage graph (``split_stages(gm, plan)[current().stage]``), or
    under the interleaved schedule its ``v`` chunks in chunk order (virtual stages
    ``s, s + p, ..``); ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
    ``"zero-bubble"`` or ``"none"`` (one stage only); ``micro_batches``: ``M``, the global batch is split
    into ``M`` equal parts along dim 0; ``grad_sync``: optional switch kept off except
    during the last backward.

    Call :meth:`step` with the model's flat inputs for the *global* batch on every rank;
    it leaves the step's gradients (summed over micro-batches, each weighted as the
    module docstring says) in the stage's parameters' ``.grad`` and returns the loss on
    every rank.
    """

    def __init__(self, stage: StageGraph | Sequence[StageGraph], schedule: Schedule | str,
                 micro_batches: int, grad_sync: Toggle | None = None,
                 slices: BoundarySlices | None = None) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        chunks = [stage] if isinstance(stage, StageGraph) else list(stage)
        mesh = current()
        p, v = mesh.stages, len(chunks)
        for c, ch in enumerate(chunks):
            want = virtual_stage(mesh.stage, c, p)
            if ch.num_stages != p * v or ch.stage != want:
                raise ValueError(f"this rank runs stage {mesh.stage} of {p} with {v} chunk(s): "
                                 f"chunk {c} must be virtual stage {want} of {p * v}, but was "
                                 f"given stage {ch.stage} of {ch.num_stages}")
        self.chunks = chunks
        self.slices = slices if slices is not None else BoundarySlices()
        self.stages, self.virtual = p, v
        self.micro_batches = micro_batches
        self.loss_scale = 1.0  # fp16 loss scaling: multiplies every backward seed
        self.schedule = Schedule(schedule)
        self.actions = actions(schedule, mesh.stage, p, micro_batches, v)
        self.grad_sync = grad_sync
        nvirt = p * v
        # boundary metas by virtual stage: what it receives, what it sends
        self._recv_meta: dict[int, list[Meta] | None] = {
            ch.stage: (None if ch.recv else []) for ch in chunks}
        self._send_meta: dict[int, list[Meta] | None] = {
            ch.stage: (None if ch.send else []) for ch in chunks}
        self._rank_of = [mesh.stage_rank(k % p) for k in range(nvirt)]
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[tuple, list] = {}
        self._expect: dict[int, deque] = {}
        # zero-bubble: per virtual stage, whether torch's B/W split covers its weights
        self._split: dict[int, bool] = {}
        self._leaves: dict[int, list[torch.Tensor]] = {}
        # torch.compile of each chunk's graph by virtual stage (compile()); empty: eager
        self._compiled: dict[int, Callable] = {}
        # the last stage's count of its loss's targets per micro-batch (token_weights)
        self._counts = {c: count_graph(ch.module, len(ch.inputs)) for c, ch in enumerate(chunks)
                        if ch.is_last}
        self._weights: list[float] | None = None
        self._forward_only = False
        # evaluate()'s boundary metas: its activations need no gradient, so their
        # headers differ from training's, and each side caches its own
        self._eval_meta = ({ch.stage: (None if ch.recv else []) for ch in chunks},
                           {ch.stage: (None if ch.send else []) for ch in chunks})

    def compile(self, *args, **kwargs) -> bool:
        """Run every chunk's graph through ``torch.compile`` (``args``/``kwargs`` as it
        takes them); the schedule, the point-to-point transfers and the gradient sync
        around them stay eager.  Not under the zero-bubble schedule, whose split of each
        backward into input and weight gradients walks the eager autograd graph
        (:mod:`autopar.runtime.split_backward`): False there, and the chunks run eagerly."""
        if self.schedule is Schedule.ZERO_BUBBLE:
            return False
        self._compiled = {ch.stage: CompiledOrEager(ch.module, f"stage {ch.stage}'s graph", *args, **kwargs)
                          for ch in self.chunks}
        return True

    @property
    def compiled(self) -> bool:
        """Whether the chunks' graphs run through ``torch.compile`` (:meth:`compile`);
        ``False`` once compiling one of them failed and it runs eagerly."""
        return bool(self._compiled) and all(c.compiled is not None for c in self._compiled.values())

    # ------------------------------------------------------------ inputs
    def split_inputs(self, inputs: Sequence, chunk: int = 0) -> list[list]:
        """Per micro-batch, the inputs model chunk ``chunk`` reads.

        A tensor input whose dim 0 is ``M`` times its captured (micro-batch) size is
        split into ``M`` equal chunks; one with its captured shape is passed whole to
        every micro-batch; anything else is an error (the global batch must be ``M``
        micro-batches of the captured size).
        """
        m = self.micro_batches
        graph = self.chunks[chunk]
        per: list[list] = [[] for _ in range(m)]
        for i, want in zip(graph.inputs, graph.input_shapes):
            x = inputs[i]
            if not isinstance(x, torch.Tensor) or want is None:
                for p in per:
                    p.append(x)
                continue
            got = tuple(x.shape)
            if m > 1 and got[1:] == want[1:] and len(got) >= 1 and got[0] == m * want[0]:
                for p, c in zip(per, x.chunk(m, dim=0)):
                    p.append(c)
            elif got == want:
                for p in per:
                    p.append(x)
            else:
                raise ValueError(
                    f"input {i} has shape {list(got)}; the graph was captured with "
                    f"{list(want)} per micro-batch, so with {m} micro-batches it must be "
                    f"{[m * want[0], *want[1:]] if want else want} (or {list(want)} if not "
                    "batched)")
        return per

    # ------------------------------------------------------------ point to point
    def _isend(self, t: torch.Tensor, dst: int) -> None:
        w = wire(t)
        self._pending.append((issue(dist.isend, w, dst=dst), w))

    def _sent_by(self, src_stage: int) -> deque:
        """The messages pipeline rank ``src_stage`` sends this rank in one step, in its
        send order: ``("H", k)`` the header of virtual stage ``k``'s activations (first
        step only), ``("A", k, i)`` activations into ``k``, ``("G", k, i)`` gradients
        into ``k``, for micro-batch ``i``."""
        p, v = self.stages, self.virtual
        mine = {ch.stage for ch in self.chunks}
        out: deque = deque()
        for a in actions(self.schedule, src_stage, p, self.micro_batches, v):
            if self._forward_only and a.op != "F":
                continue
            k = virtual_stage(src_stage, a.chunk, p)
            if a.op == "F" and k + 1 in mine:
                if self._recv_meta[k + 1] is None and ("H", k + 1) not in out:
                    out.append(("H", k + 1))
                if self.chunks[(k + 1) // p].recv:
                    out.append(("A", k + 1, a.micro))
            elif a.op == "B" and k - 1 in mine and self._carries_grad(k - 1):
                out.append(("G", k - 1, a.micro))
        return out

    def _carries_grad(self, k: int) -> bool:
        return bool(self.chunks[k // self.stages].send)

    def _post(self, key: tuple) -> None:
        """Post this rank's receives from ``key``'s sender in its send order, up to
        ``key`` (the headers among them are received at once: later buffers need them)."""
        src = (key[1] - 1 if key[0] != "G" else key[1] + 1) % self.stages
        q = self._expect.setdefault(src, self._sent_by(src))
        while key not in self._posted:
            if not q:
                raise RuntimeError(f"pipeline message {key} is not in stage {src}'s schedule")
            e = q.popleft()
            peer = self._rank_of[src]
            if e[0] == "H":
                n = len(self.chunks[e[1] // self.stages].recv)
                h = torch.empty(n * HEADER, dtype=torch.int64, device=current().device)
                issue(dist.recv, h, src=peer)
                self._recv_meta[e[1]] = decode(h, n)
                continue
            graph = self.chunks[e[1] // self.stages]
            if e[0] == "A":
                named = list(zip(graph.recv, self._recv_meta[e[1]]))
            else:
                sent = self._send_meta[e[1]]
                if sent is None:
                    raise RuntimeError(f"gradients for virtual stage {e[1]} before its forward")
                named = [(n, m) for n, m in zip(graph.send, sent) if m.requires_grad]
            posted = []
            for n, m in named:  # a value sliced over its replicated axes arrives as a slice
                b = torch.empty(self.slices.buffer_shape(n, m.shape), device=current().device,
                                dtype=torch.uint8 if m.dtype == torch.bool else m.dtype)
                posted.append((issue(dist.irecv, b, src=peer), b, m, n))
            self._posted[e] = posted

    def _take(self, key: tuple) -> list[torch.Tensor]:
        self._post(key)
        out = []
        for w, b, m, n in self._posted.pop(key):
            w.wait()
            b = self.slices.join(n, b, m.shape) if key[0] == "A" else self.slices.spread(n, b, m.shape)
            t = b.to(torch.bool) if m.dtype == torch.bool else b
            if key[0] == "A" and m.requires_grad:
                t.requires_grad_(True)
            out.append(t)
        return out

    def _send_activations(self, k: int, values: list[torch.Tensor]) -> None:
        graph = self.chunks[k // self.stages]
        for name, v in zip(graph.send, values):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"boundary value {name} is a {type(v).__name__}, not a tensor")
        metas = [Meta(tuple(v.shape), v.dtype, v.requires_grad) for v in values]
        dst = self._rank_of[k + 1]
        if self._send_meta[k] is None:
            self._send_meta[k] = metas
            self._isend(encode(metas), dst)
        elif metas != self._send_meta[k]:
            raise RuntimeError(f"boundary values changed shape between micro-batches: "
                               f"{metas} vs {self._send_meta[k]}")
        for name, v in zip(graph.send, values):
            self._isend(self.slices.cut(name, v), dst)

    # ------------------------------------------------------------ actions
    def _forward(self, graph: StageGraph, inputs: list, micro: int) -> _MicroBatch:
        mb = _MicroBatch()
        k = graph.stage
        if not graph.is_first and graph.recv:
            mb.received = self._take(("A", k, micro))
        outs = self._compiled.get(k, graph.module)(*inputs, *mb.received)
        ns = len(graph.send)
        mb.sent = list(outs[:ns])
        if graph.is_last:
            if graph.num_outputs != 1:
                raise ValueError(f"the pipelined graph must return exactly one value (the "
                                 f"loss), got {graph.num_outputs}")
            loss = outs[ns]
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("the pipelined model must return a scalar loss (a mean over "
                                 f"the batch); got {getattr(loss, 'shape', type(loss))}")
            mb.loss = loss
        elif graph.send:
            self._send_activations(k, mb.sent)
        return mb

    def _backward(self, graph: StageGraph, mb: _MicroBatch, micro: int) -> None:
        """``B``: the micro-batch's backward (under the zero-bubble schedule only its
        inputs' gradients; :meth:`_weights_of` does the rest at ``W``)."""
        k = graph.stage
        if graph.is_last:
            tensors = [mb.loss]
            seeds = [torch.full_like(mb.loss, self.loss_scale * self._weight(micro))]
        elif graph.send:
            sent = self._send_meta[k]
            assert sent is not None
            seeds = self._take(("G", k, micro))
            tensors = [v for v, m in zip(mb.sent, sent) if m.requires_grad]
        else:
            tensors, seeds = [], []
        live = [(t, g) for t, g in zip(tensors, seeds) if t.requires_grad]
        if self.schedule is Schedule.ZERO_BUBBLE:
            outs, gs = [t for t, _ in live], [g for _, g in live]
            ins = [t for t in mb.received if t.requires_grad]
            if k not in self._split and outs:
                # the same leaves every micro-batch: found (and the split checked) once
                self._leaves[k] = leaves(outs, ins)
                self._split[k] = splits_cleanly(outs, ins, self._leaves[k])
            weights = self._leaves.get(k, [])
            mb.pending = backward_input(outs, gs, ins, weights, self._split.get(k, False)) \
                if outs else None
        elif live:
            torch.autograd.backward([t for t, _ in live], [g for _, g in live])
        if not graph.is_first:
            for name, t in zip(graph.recv, mb.received):
                if t.requires_grad:
                    g = t.grad if t.grad is not None else torch.zeros_like(t)
                    self._isend(self.slices.reduce_cut(name, g), self._rank_of[k - 1])

    def _weight(self, micro: int) -> float:
        """Micro-batch ``micro``'s weight in the step's loss (see the module docstring)."""
        return self._weights[micro] if self._weights is not None else 1.0 / self.micro_batches

    def _count_targets(self, per: list[list[list]]) -> list[float] | None:
        """Every micro-batch's share of the batch's loss targets, on the rank that holds
        the last stage with a graph that counts them; else None (``1/M`` each)."""
        for c, counts in self._counts.items():
            if counts is GIVEN_COUNT:
                return [1.0] * self.micro_batches
            if counts is not None:
                return counts.weights([per[c][i] for i in range(self.micro_batches)])
        return None

    @staticmethod
    def _weights_of(mb: _MicroBatch) -> None:
        """``W`` (zero-bubble): the micro-batch's weight gradients; frees its graph."""
        if mb.pending is not None:
            backward_weight(mb.pending)
            mb.pending = None

    # ------------------------------------------------------------ the step
    def step(self, inputs: Sequence) -> torch.Tensor:
        """One training step on the global batch ``inputs`` (flat, as the captured
        model takes them); returns the mean micro-batch loss on every rank."""
        per = self._begin(inputs)
        kept: dict[tuple[int, int], _MicroBatch] = {}
        losses: list[torch.Tensor] = []
        sync_was = self.grad_sync.enabled if self.grad_sync is not None else None
        zb = self.schedule is Schedule.ZERO_BUBBLE
        # gradients are reduced during the last backward (its hooks); under the
        # zero-bubble schedule W bypasses hooks, so after the last W (flush)
        last_b = -1 if zb else max(j for j, a in enumerate(self.actions) if a.op == "B")
        try:
            if self.grad_sync is not None:
                self.grad_sync.enabled = False
            for j, a in enumerate(self.actions):
                graph = self.chunks[a.chunk]
                if a.op == "F":
                    mb = kept[(a.chunk, a.micro)] = self._forward(graph, per[a.chunk][a.micro],
                                                                   a.micro)
                    if mb.loss is not None:
                        losses.append(self._weighted(mb.loss.detach(), a.micro))
                elif a.op == "B":
                    if self.grad_sync is not None:
                        self.grad_sync.enabled = j == last_b
                    # frees micro-batch i's activations of this chunk (zero-bubble: at W)
                    mb = kept[(a.chunk, a.micro)] if zb else kept.pop((a.chunk, a.micro))
                    self._backward(graph, mb, a.micro)
                else:
                    self._weights_of(kept.pop((a.chunk, a.micro)))
            if zb and self.grad_sync is not None:
                self.grad_sync.flush()
            for w, _ in self._pending:
                w.wait()
        finally:
            self._pending.clear()
            if self.grad_sync is not None:
                self.grad_sync.enabled = bool(sync_was)
        return self._end(losses)

    def evaluate(self, inputs: Sequence) -> torch.Tensor:
        """The loss of the global batch ``inputs`` without a backward (an evaluation):
        every micro-batch's forward in the schedule's order, weighted as :meth:`step`
        weighs them; the same value on every rank."""
        per = self._begin(inputs)
        train = (self._recv_meta, self._send_meta)
        self._recv_meta, self._send_meta = self._eval_meta
        self._forward_only = True
        losses: list[torch.Tensor] = []
        try:
            with torch.no_grad():
                for a in self.actions:
                    if a.op == "F":
                        mb = self._forward(self.chunks[a.chunk], per[a.chunk][a.micro], a.micro)
                        if mb.loss is not None:
                            losses.append(self._weighted(mb.loss, a.micro))
                for w, _ in self._pending:
                    w.wait()
        finally:
            self._pending.clear()
            self._forward_only = False
            self._recv_meta, self._send_meta = train
        return self._end(losses)

    def _begin(self, inputs: Sequence) -> list[list[list]]:
        """A step's (or an evaluation's) start: ``inputs`` split per model chunk and
        micro-batch, the micro-batches' weights counted, no message expected yet."""
        per = [self.split_inputs(inputs, c) for c in range(self.virtual)]
        self._weights = self._count_targets(per)
        self._expect.clear()
        return per

    def _weighted(self, loss: torch.Tensor, micro: int) -> torch.Tensor:
        """Micro-batch ``micro``'s loss scaled so that the mean of the scaled losses is
        the batch's (:meth:`_weight` times the count)."""
        return loss * (self._weight(micro) * self.micro_batches)

    def _end(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The batch's loss on every rank, once every message of the step was received."""
        if self._posted or any(self._expect.values()):
            raise RuntimeError(f"pipeline messages left unreceived: {sorted(self._posted)}")
        return self._loss(losses)

    def _loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        mesh = current()
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32,
                                                                      device=mesh.device)
        if self.stages > 1:
            # the last stage's dtype is unknown to the others: compute in float32
            loss = loss.to(torch.float32).reshape(())
            issue(dist.broadcast, loss, src=mesh.stage_rank(self.stages - 1),
                  group=mesh.device_mesh.get_group(0))
        return loss


__all__ = ["PipelineRunner", "Toggle"]
