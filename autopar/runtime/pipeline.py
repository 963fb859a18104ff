"""Pipeline-parallel training step for one rank (and gradient accumulation, its
one-stage case).

:class:`PipelineRunner` runs this rank's :class:`~autopar.passes.split_stages.StageGraph`
over ``M`` micro-batches of the global batch under a schedule:

* **GPipe**: ``F0 F1 .. F(M-1) B0 B1 .. B(M-1)`` on every stage;
* **1F1B**: stage ``s`` of ``S`` runs ``w = min(S - s - 1, M)`` warm-up forwards, then
  alternates one forward and one backward, then the ``w`` remaining backwards, so it
  holds at most ``w + 1`` micro-batches of activations.

A forward ``F(i)`` receives the boundary activations of micro-batch ``i`` from stage
``s-1``, runs the stage graph and sends its boundary values to ``s+1``; a backward
``B(i)`` receives their gradients from ``s+1``, runs autograd and sends the gradients
of the received activations to ``s-1``.  Peers are ``current().stage_rank(s ± 1)``: the
rank with the same sub-mesh coordinate in the neighbouring stage, on the default
process group (``isend``/``irecv``, gloo or nccl).

**Why it cannot deadlock.** Sends are non-blocking (``isend``, waited at the end of the
step), so a rank only ever blocks on a receive.  Each schedule is a topological order
of the dependency graph ``F(s-1,i) -> F(s,i)``, ``B(s+1,i) -> B(s,i)``,
``F(S-1,i) -> B(S-1,i)`` that also keeps every stage's forwards and backwards in
increasing micro-batch order; the union of those per-rank program orders with the
cross-stage edges is acyclic (the standard GPipe/1F1B argument), so every awaited
message is eventually sent.  Matching is by order: on each directed link (``s -> s+1``
carries activations only, ``s+1 -> s`` gradients only) messages are posted and
received in the same order (micro-batch, then ``StageGraph.send`` order), which point
to point FIFO semantics on one (src, dst, tag) pair make unambiguous.  Collectives
inside a stage (tensor parallelism, gradient sync) use the stage's sub-mesh groups,
whose ranks all run the same schedule, so they are issued in the same order too.

**Boundary shapes** are exchanged once: the first activation message on each link is
preceded by a small int64 header per value (dtype, requires-grad, shape); both sides
cache it.  Micro-batches all have the same shape, so later steps skip it.  This stays
right for values inserted by lowering (collective outputs), whose local shapes are in
no graph metadata.

**Loss.** The stage graph's output must be one scalar per micro-batch: the model's loss,
a *mean* over the micro-batch (already scaled for the sub-mesh by ``scale_grad``).  Each
micro-batch's backward is seeded with ``1/M``, so the accumulated gradients are those
of the mean of the micro-batch losses, which equals the global-batch mean whenever
every micro-batch averages over the same number of elements (true for equal splits of
a mean loss without ignored targets; with ``ignore_index`` tokens unevenly spread it
is the usual gradient-accumulation approximation).  The step returns the mean of the
micro-batch losses, broadcast from the last stage over the pipeline axis.

**Gradient sync.** An optional ``grad_sync`` (anything with a boolean ``enabled``, e.g.
:class:`~autopar.runtime.grad_sync.GradSync`) is disabled for every backward except
this stage's last micro-batch backward, so data-parallel all-reduces run once per step
on the fully accumulated gradients (they would otherwise add every partial gradient
again on each backward).  Its previous ``enabled`` value is restored after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from autopar.passes.split_stages import StageGraph
from autopar.plan import Schedule
from autopar.runtime.mesh import current
from autopar.runtime.tls import issue

# dtypes a boundary value may have, by header code
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype code, requires_grad, ndim, dims


class Toggle(Protocol):
    """What the runner needs of a gradient synchroniser: an on/off switch."""

    enabled: bool


def schedule_actions(schedule: Schedule | str, stage: int, stages: int,
                     micro_batches: int) -> list[tuple[str, int]]:
    """The ordered forward/backward actions of ``stage`` (see the module docstring).

    ``Schedule.NONE`` (no pipeline) runs each micro-batch's forward and backward in
    turn, which keeps one micro-batch of activations alive (gradient accumulation).
    """
    m = micro_batches
    sched = Schedule(schedule)
    if sched is Schedule.GPIPE:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if sched is Schedule.ONE_F_ONE_B or stages == 1:
        warm = min(stages - stage - 1, m) if sched is Schedule.ONE_F_ONE_B else 0
        acts = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [("F", warm + i), ("B", i)]
        acts += [("B", i) for i in range(m - warm, m)]
        return acts
    raise ValueError(f"schedule {sched.value!r} needs one stage; a {stages}-stage pipeline "
                     "needs 'gpipe' or '1f1b'")


@dataclass
class _Meta:
    """Shape, dtype and whether a boundary value carries a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class _MicroBatch:
    """What a forward keeps for its backward."""

    received: list[torch.Tensor] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None


def _encode(metas: list[_Meta]) -> torch.Tensor:
    h = torch.zeros(len(metas) * _HEADER, dtype=torch.int64, device=current().device)
    for j, m in enumerate(metas):
        if len(m.shape) > _MAX_DIMS:
            raise ValueError(f"boundary value with {len(m.shape)} dims (at most {_MAX_DIMS})")
        if m.dtype not in _DTYPES:
            raise ValueError(f"boundary value of dtype {m.dtype} cannot be sent")
        row = [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        h[j * _HEADER: j * _HEADER + len(row)] = torch.tensor(row, device=h.device)
    return h


def _decode(h: torch.Tensor, n: int) -> list[_Meta]:
    out = []
    for j in range(n):
        row = h[j * _HEADER:(j + 1) * _HEADER].tolist()
        out.append(_Meta(tuple(row[3:3 + row[2]]), _DTYPES[row[0]], bool(row[1])))
    return out


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool point-to-point: send bytes
    t = t.detach()
    return (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()


class PipelineRunner:
    """Runs training steps of one rank's pipeline stage.

    ``stage``: this rank's stage graph (``split_stages(gm, plan)[current().stage]``);
    ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"none"`` (one stage only);
    ``micro_batches``: ``M``, the global batch is split into ``M`` equal parts along dim 0;
    ``grad_sync``: optional switch kept off except during the last backward.

    Call :meth:`step` with the model's flat inputs for the *global* batch on every rank;
    it leaves the step's gradients (summed over micro-batches, weight ``1/M``) in the
    stage's parameters' ``.grad`` and returns the loss on every rank.
    """

    def __init__(self, stage: StageGraph, schedule: Schedule | str, micro_batches: int,
                 grad_sync: Toggle | None = None) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        mesh = current()
        if mesh.stages != stage.num_stages or mesh.stage != stage.stage:
            raise ValueError(f"this rank runs stage {mesh.stage} of {mesh.stages} but was given "
                             f"stage {stage.stage} of {stage.num_stages}")
        self.stage = stage
        self.micro_batches = micro_batches
        self.actions = schedule_actions(schedule, stage.stage, stage.num_stages, micro_batches)
        self.grad_sync = grad_sync
        self._prev = mesh.stage_rank(stage.stage - 1) if not stage.is_first else None
        self._next = mesh.stage_rank(stage.stage + 1) if not stage.is_last else None
        self._recv_meta: list[_Meta] | None = None if stage.recv else []
        self._send_meta: list[_Meta] | None = None if stage.send else []
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    # ------------------------------------------------------------ inputs
    def split_inputs(self, inputs: Sequence) -> list[list]:
        """Per micro-batch, the inputs this stage reads.

        A tensor input whose dim 0 is ``M`` times its captured (micro-batch) size is
        split into ``M`` equal chunks; one with its captured shape is passed whole to
        every micro-batch; anything else is an error (the global batch must be ``M``
        micro-batches of the captured size).
        """
        m = self.micro_batches
        per: list[list] = [[] for _ in range(m)]
        for i, want in zip(self.stage.inputs, self.stage.input_shapes):
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
        w = _wire(t)
        self._pending.append((issue(dist.isend, w, dst=dst), w))

    def _recv(self, metas: list[_Meta], src: int, grads: bool) -> list[torch.Tensor]:
        bufs = []
        for m in metas:
            dtype = torch.uint8 if m.dtype == torch.bool else m.dtype
            bufs.append(torch.empty(m.shape, dtype=dtype, device=current().device))
        works = [issue(dist.irecv, b, src=src) for b in bufs]
        for w in works:
            w.wait()
        out = []
        for b, m in zip(bufs, metas):
            t = b.to(torch.bool) if m.dtype == torch.bool else b
            if not grads and m.requires_grad:
                t.requires_grad_(True)
            out.append(t)
        return out

    def _recv_activations(self) -> list[torch.Tensor]:
        if self._recv_meta is None:
            h = torch.empty(len(self.stage.recv) * _HEADER, dtype=torch.int64, device=current().device)
            issue(dist.recv, h, src=self._prev)
            self._recv_meta = _decode(h, len(self.stage.recv))
        return self._recv(self._recv_meta, self._prev, grads=False)

    def _send_activations(self, values: list[torch.Tensor]) -> None:
        for name, v in zip(self.stage.send, values):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"boundary value {name} is a {type(v).__name__}, not a tensor")
        metas = [_Meta(tuple(v.shape), v.dtype, v.requires_grad) for v in values]
        if self._send_meta is None:
            self._send_meta = metas
            self._isend(_encode(metas), self._next)
        elif metas != self._send_meta:
            raise RuntimeError(f"boundary values changed shape between micro-batches: "
                               f"{metas} vs {self._send_meta}")
        for v in values:
            self._isend(v, self._next)

    # ------------------------------------------------------------ actions
    def _forward(self, inputs: list) -> _MicroBatch:
        mb = _MicroBatch()
        if not self.stage.is_first:
            mb.received = self._recv_activations()
        outs = self.stage.module(*inputs, *mb.received)
        ns = len(self.stage.send)
        mb.sent = list(outs[:ns])
        if self.stage.is_last:
            if self.stage.num_outputs != 1:
                raise ValueError(f"the pipelined graph must return exactly one value (the "
                                 f"loss), got {self.stage.num_outputs}")
            loss = outs[ns]
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("the pipelined model must return a scalar loss (a mean over "
                                 f"the batch); got {getattr(loss, 'shape', type(loss))}")
            mb.loss = loss
        else:
            self._send_activations(mb.sent)
        return mb

    def _backward(self, mb: _MicroBatch) -> None:
        if self.stage.is_last:
            tensors = [mb.loss]
            seeds = [torch.full_like(mb.loss, 1.0 / self.micro_batches)]
        else:
            assert self._send_meta is not None
            carry = [m for m in self._send_meta if m.requires_grad]
            got = self._recv(carry, self._next, grads=True)
            tensors = [v for v, m in zip(mb.sent, self._send_meta) if m.requires_grad]
            seeds = got
        live = [(t, g) for t, g in zip(tensors, seeds) if t.requires_grad]
        if live:
            torch.autograd.backward([t for t, _ in live], [g for _, g in live])
        if not self.stage.is_first:
            for t in mb.received:
                if t.requires_grad:
                    g = t.grad if t.grad is not None else torch.zeros_like(t)
                    self._isend(g, self._prev)

    # ------------------------------------------------------------ the step
    def step(self, inputs: Sequence) -> torch.Tensor:
        """One training step on the global batch ``inputs`` (flat, as the captured
        model takes them); returns the mean micro-batch loss on every rank."""
        per = self.split_inputs(inputs)
        kept: dict[int, _MicroBatch] = {}
        losses: list[torch.Tensor] = []
        sync_was = self.grad_sync.enabled if self.grad_sync is not None else None
        last_b = max(i for a, i in self.actions if a == "B")
        try:
            if self.grad_sync is not None:
                self.grad_sync.enabled = False
            for act, i in self.actions:
                if act == "F":
                    kept[i] = self._forward(per[i])
                    if kept[i].loss is not None:
                        losses.append(kept[i].loss.detach())
                else:
                    if self.grad_sync is not None:
                        self.grad_sync.enabled = i == last_b
                    self._backward(kept.pop(i))  # frees micro-batch i's activations
            for w, _ in self._pending:
                w.wait()
        finally:
            self._pending.clear()
            if self.grad_sync is not None:
                self.grad_sync.enabled = bool(sync_was)
        return self._loss(losses)

    def _loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        mesh = current()
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32,
                                                                      device=mesh.device)
        if self.stage.num_stages > 1:
            # the last stage's dtype is unknown to the others: compute in float32
            loss = loss.to(torch.float32).reshape(())
            issue(dist.broadcast, loss, src=mesh.stage_rank(self.stage.num_stages - 1),
                           group=mesh.device_mesh.get_group(0))
        return loss


__all__ = ["PipelineRunner", "Toggle", "schedule_actions"]
