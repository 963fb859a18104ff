"""Pipeline schedules as the ordered actions each pipeline rank runs.

One place decides the order of forwards and backwards, so the runtime
(:mod:`autopar.runtime.pipeline`), the predicted timeline (:mod:`autopar.report.timeline`)
and the memory price (:mod:`autopar.search.stages.pipeline_step`) agree on it.  An :class:`Action`
is a forward ``F`` or backward ``B`` of one micro-batch on one model chunk of the rank;
the chunk is 0 except under the interleaved schedule, where rank ``s`` of ``p`` holds
chunks ``c = 0 .. v-1``, virtual stage ``c * p + s`` (Megatron's layout).

* **none** (one stage): each micro-batch's forward then its backward (gradient
  accumulation, one micro-batch of activations alive);
* **GPipe**: all forwards, then all backwards;
* **1F1B**: ``p - s - 1`` warm-up forwards, then one forward / one backward;
* **zero-bubble** (ZB-H1's bubble): each backward split into ``B`` (input gradients,
  on the critical path) and ``W`` (weight gradients, deferred into the gaps of the
  drain); the order comes from one unit-time simulation every rank runs alike
  (:func:`_zero_bubble`);
* **interleaved 1F1B** (``M`` a multiple of ``p``): forwards go through the chunks in
  groups of ``p`` micro-batches (chunk 0 of micro-batches ``0..p-1``, chunk 1 of the
  same, .., then the next group), backwards the same with the chunks reversed;
  ``2 (p - s - 1) + (v - 1) p`` warm-up forwards (at most ``M v``), then one forward /
  one backward.  Each micro-batch passes every rank ``v`` times, so the fill and drain
  are ``v`` times shorter while the point-to-point messages are ``v`` times more.

Dependencies: ``F(k, i)`` needs ``F(k-1, i)``; ``B(k, i)`` needs ``F(k, i)`` and
``B(k+1, i)`` (``k`` the virtual stage).  :func:`list_schedule` runs the ranks' orders
against them and raises on a deadlock; the tests run it on every schedule shape.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from autopar.plans.kinds import Schedule


@dataclass(frozen=True)
class Action:
    """One forward (``op == "F"``) or backward (``"B"``; under the zero-bubble schedule
    ``B`` computes the input gradients and ``W`` the weight gradients) of micro-batch
    ``micro`` on this rank's model chunk ``chunk``."""

    op: str
    chunk: int
    micro: int


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    """The virtual stage of ``chunk`` on pipeline rank ``stage`` (``chunk * stages +
    stage``; the stage itself without interleaving)."""
    return chunk * stages + stage


def check(schedule: Schedule | str, stages: int, micro_batches: int, virtual: int = 1) -> None:
    """Raise ValueError when the schedule cannot run this shape (the message says why)."""
    sched = Schedule(schedule)
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if sched is Schedule.INTERLEAVED:
        if stages < 2 or virtual < 2:
            raise ValueError(f"the interleaved schedule needs >= 2 pipeline stages and >= 2 "
                             f"virtual stages per rank, got {stages} and {virtual}")
        if micro_batches % stages:
            raise ValueError(f"the interleaved schedule runs micro-batches in groups of the "
                             f"{stages} pipeline stages: {micro_batches} micro-batches is not "
                             "a multiple")
    elif virtual != 1:
        raise ValueError(f"{virtual} virtual stages per rank need schedule "
                         f"{Schedule.INTERLEAVED.value!r}, not {sched.value!r}")
    elif sched is Schedule.NONE and stages > 1:
        raise ValueError(f"schedule 'none' needs one stage; a {stages}-stage pipeline needs "
                         "'gpipe', '1f1b', 'zero-bubble' or 'interleaved-1f1b'")


def micro_batch_counts(rows: int, planned_rows: int, schedule: Schedule | str, stages: int,
                       virtual: int = 1) -> list[int]:
    """The counts of equal micro-batches a global batch of ``rows`` rows can run as, best
    first, under a plan whose micro-batches have ``planned_rows`` rows: those no larger
    than planned (the plan's activation memory holds), largest first (fewest
    micro-batches, least overhead); then larger ones, smallest first.  Only counts that
    divide ``rows`` and that the schedule can run (:func:`check`: an interleaved schedule
    needs a multiple of its stages); empty when none can."""
    def runs(m: int) -> bool:
        try:
            check(schedule, stages, m, virtual)
        except ValueError:
            return False
        return True

    counts = [m for m in range(1, rows + 1) if rows % m == 0 and runs(m)]
    within = [m for m in counts if rows // m <= planned_rows]
    return within + [m for m in reversed(counts) if rows // m > planned_rows]


def conflict(schedule: Schedule | str | None, recompute: bool, zero_stage: int | None) -> str | None:
    """What keeps ``schedule`` from running with these decisions, or None.  The
    zero-bubble schedule's split backward runs neither recomputation
    (``torch.utils.checkpoint`` cannot re-run inside it) nor ZeRO-3 (its gathers live
    inside backward).  The search skips such configs; forced ones and loaded plans
    are errors that quote this."""
    if schedule is None or Schedule(schedule) is not Schedule.ZERO_BUBBLE:
        return None
    if recompute:
        return ("recompute: torch.utils.checkpoint cannot recompute inside the schedule's "
                "split backward")
    if zero_stage == 3:
        return ("zero_stage=3: ZeRO-3 gathers weights inside backward, which the schedule "
                "splits in two")
    return None


def actions(schedule: Schedule | str, stage: int, stages: int, micro_batches: int,
            virtual: int = 1) -> list[Action]:
    """The ordered actions of pipeline rank ``stage`` (see the module docstring)."""
    check(schedule, stages, micro_batches, virtual)
    sched, m = Schedule(schedule), micro_batches
    if sched is Schedule.INTERLEAVED:
        return _interleaved(stage, stages, m, virtual)
    if sched is Schedule.ZERO_BUBBLE:
        return list(_zero_bubble(stages, m)[stage])
    if sched is Schedule.GPIPE:
        return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]
    warm = min(stages - stage - 1, m) if sched is Schedule.ONE_F_ONE_B else 0
    out = [Action("F", 0, i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", 0, warm + i), Action("B", 0, i)]
    return out + [Action("B", 0, i) for i in range(m - warm, m)]


def _interleaved(stage: int, stages: int, m: int, v: int) -> list[Action]:
    total = m * v

    def unit(k: int, op: str) -> Action:
        group, chunk = divmod(k // stages, v)
        micro = group * stages + k % stages
        return Action(op, chunk if op == "F" else v - 1 - chunk, micro)

    warm = min(2 * (stages - stage - 1) + (v - 1) * stages, total)
    out = [unit(k, "F") for k in range(warm)]
    for k in range(total - warm):
        out += [unit(warm + k, "F"), unit(k, "B")]
    return out + [unit(k, "B") for k in range(total - warm, total)]


@functools.lru_cache(maxsize=64)
def _zero_bubble(stages: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's order under the zero-bubble schedule, from one simulation in unit
    time steps (``F``, ``B`` and ``W`` one step each, the ZB paper's assumption) that
    every rank runs identically: a free rank runs its next ``B`` if its gradient has
    arrived, else its next ``F`` if its input has arrived and fewer than ``p - s``
    micro-batches wait for their ``B``, else its oldest pending ``W``; a rank with ``p``
    pending ``W`` runs one first (that bounds memory: ``2p - 1`` in flight at most)."""
    busy, n_f, n_b, n_w = [0] * stages, [0] * stages, [0] * stages, [0] * stages
    pending: list[deque[int]] = [deque() for _ in range(stages)]
    done_f: dict[tuple[int, int], int] = {}
    done_b: dict[tuple[int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(stages)]
    never = 1 << 62
    t = 0
    while any(n < m for n in n_w):
        for s in range(stages):
            if busy[s] > t:
                continue
            i, j = n_b[s], n_f[s]
            if pending[s] and len(pending[s]) >= stages:
                a = Action("W", 0, pending[s].popleft())
                n_w[s] += 1
            elif i < j and (done_f[(s, i)] if s == stages - 1 else done_b.get((s + 1, i), never)) <= t:
                a = Action("B", 0, i)
                done_b[(s, i)] = t + 1
                n_b[s] += 1
                pending[s].append(i)
            elif j < m and j - i < stages - s and (s == 0 or done_f.get((s - 1, j), never) <= t):
                a = Action("F", 0, j)
                done_f[(s, j)] = t + 1
                n_f[s] += 1
            elif pending[s]:
                a = Action("W", 0, pending[s].popleft())
                n_w[s] += 1
            else:
                continue
            orders[s].append(a)
            busy[s] = t + 1
        t += 1
    return tuple(tuple(o) for o in orders)


def in_flight(schedule: Schedule | str, stages: int, micro_batches: int,
              virtual: int = 1) -> list[list[int]]:
    """Per rank and chunk, the most micro-batches whose forward has run and backward
    has not (under the zero-bubble schedule: whose ``W`` has not), at any point of the
    rank's order (the activations a chunk keeps)."""
    return [list(r) for r in in_flight_table(Schedule(schedule).value, stages, micro_batches,
                                             virtual)]


@functools.lru_cache(maxsize=4096)
def in_flight_table(schedule: str, stages: int, micro_batches: int,
                    virtual: int = 1) -> tuple[tuple[int, ...], ...]:
    """:func:`in_flight`, cached (the split search asks once per stage it prices).  Under
    zero-bubble and interleaving the counts settle once there are ``2 p v`` micro-batches
    (the warm-up holds the most; the steady state frees one as it starts one): more are
    counted as that many, so 2,304 micro-batches are not simulated (tested to ``10 p v``)."""
    frees = "W" if Schedule(schedule) is Schedule.ZERO_BUBBLE else "B"
    settled = 2 * stages * virtual
    if micro_batches > settled and (frees == "W" or (
            Schedule(schedule) is Schedule.INTERLEAVED and micro_batches % stages == 0)):
        return in_flight_table(schedule, stages, settled, virtual)
    out = []
    for s in range(stages):
        alive, peak = [0] * virtual, [0] * virtual
        for a in actions(schedule, s, stages, micro_batches, virtual):
            if a.op == "F":
                alive[a.chunk] += 1
            elif a.op == frees:
                alive[a.chunk] -= 1
            peak[a.chunk] = max(peak[a.chunk], alive[a.chunk])
        out.append(tuple(peak))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def waiting_w(stages: int, micro_batches: int) -> tuple[int, ...]:
    """Zero-bubble: per rank, the most micro-batches whose ``B`` has run and ``W`` has
    not (each keeps the gradients ``W`` starts from); settled from ``2 p`` micro-batches
    on, as :func:`in_flight_table`."""
    if micro_batches > 2 * stages:
        return waiting_w(stages, 2 * stages)
    out = []
    for order in _zero_bubble(stages, micro_batches):
        n = peak = 0
        for a in order:
            n += 1 if a.op == "B" else -1 if a.op == "W" else 0
            peak = max(peak, n)
        out.append(peak)
    return tuple(out)


@dataclass(frozen=True)
class Timed:
    """An action of pipeline rank ``stage`` placed in time by :func:`list_schedule`."""

    stage: int
    action: Action
    start: float
    end: float


def list_schedule(schedule: Schedule | str, stages: int, micro_batches: int, virtual: int,
                  duration: Callable[[int, Action], float]) -> list[Timed]:
    """Run every rank's order against the dependencies (module docstring), each action
    as soon as its rank is free and its inputs exist; ``duration(stage, action)`` its
    seconds.  Raises ValueError if the orders deadlock."""
    orders = [actions(schedule, s, stages, micro_batches, virtual) for s in range(stages)]
    last = stages * virtual - 1
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * stages, [0] * stages
    out: list[Timed] = []
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] >= len(orders[s]):
                continue
            a = orders[s][pos[s]]
            k = virtual_stage(s, a.chunk, stages)
            if a.op == "F":
                ready = 0.0 if k == 0 else done.get(("F", k - 1, a.micro))
            elif a.op == "W":  # after its own B, which the rank's order already ran
                ready = 0.0
            else:
                own = done.get(("F", k, a.micro))
                nxt = own if k == last else done.get(("B", k + 1, a.micro))
                ready = None if own is None or nxt is None else max(own, nxt)
            if ready is None:
                continue
            start = max(free[s], ready)
            done[(a.op, k, a.micro)] = free[s] = start + duration(s, a)
            out.append(Timed(s, a, start, free[s]))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"schedule {Schedule(schedule).value!r} deadlocks with {stages} "
                             f"stages, {micro_batches} micro-batches, {virtual} virtual stages")
    return out


__all__ = ["micro_batch_counts", "Action", "Timed", "actions", "check", "conflict", "in_flight", "in_flight_table", "list_schedule",
           "virtual_stage", "waiting_w"]
