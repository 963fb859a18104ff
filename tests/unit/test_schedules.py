"""Pipeline schedules (autopar/plans/schedules.py): every shape runs to the end against the
dependencies, each forward and backward runs exactly once, and the interleaved
schedule's bubble and in-flight counts are those the search prices."""

from __future__ import annotations

import pytest
from autopar.cost_models import MeshSpec

from autopar.plans.kinds import Schedule
from autopar.plans.schedules import actions, check, in_flight, list_schedule
from autopar.search.stages.priced import Config
from autopar.search.stages.step_terms import in_flight as priced_in_flight

SHAPES = [("gpipe", s, m, 1) for s in (2, 3, 5) for m in (1, 2, 7)] + \
    [("1f1b", s, m, 1) for s in (2, 3, 5) for m in (1, 2, 7)] + \
    [("none", 1, m, 1) for m in (1, 3)] + \
    [("interleaved-1f1b", s, k * s, v) for s in (2, 3, 4) for k in (1, 2, 3) for v in (2, 3, 4)] + \
    [("zero-bubble", s, m, 1) for s in (2, 3, 4, 8) for m in (1, 2, 5, 8, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
def test_every_schedule_runs_each_action_once(shape) -> None:
    sched, stages, micro, virtual = shape
    for s in range(stages):
        acts = actions(sched, s, stages, micro, virtual)
        ops = "FBW" if sched == "zero-bubble" else "FB"
        want = {(op, c, i) for op in ops for c in range(virtual) for i in range(micro)}
        assert sorted((a.op, a.chunk, a.micro) for a in acts) == sorted(want)
        # a chunk's forwards and backwards each run in micro-batch order (the runner
        # matches messages by order), and a backward follows its forward
        for c in range(virtual):
            for op in ops:
                seen = [a.micro for a in acts if a.op == op and a.chunk == c]
                assert seen == sorted(seen)
            pos = {(a.op, a.micro): j for j, a in enumerate(acts) if a.chunk == c}
            assert all(pos[("F", i)] < pos[("B", i)] for i in range(micro))
            if sched == "zero-bubble":  # a micro-batch's weight gradients after its B
                assert all(pos[("B", i)] < pos[("W", i)] for i in range(micro))
    # and the ranks' orders together never deadlock
    timed = list_schedule(sched, stages, micro, virtual, lambda s, a: 1.0)
    assert len(timed) == len(ops) * stages * micro * virtual


@pytest.mark.parametrize("stages,micro,virtual", [(4, 8, 2), (4, 8, 3), (4, 4, 4), (2, 6, 2)])
def test_interleaving_divides_the_bubble(stages, micro, virtual) -> None:
    # equal chunks: forward 1, backward 2 per rank and micro-batch, split over the chunks
    def one(s, a):
        return 1.0 if a.op == "F" else 2.0

    def chunked(s, a):
        return one(s, a) / virtual

    plain = max(t.end for t in list_schedule("1f1b", stages, micro, 1, one))
    inter = max(t.end for t in list_schedule("interleaved-1f1b", stages, micro, virtual, chunked))
    work = 3.0 * micro
    # 1F1B idles (p - 1) micro-batch times; interleaving v chunks idles a v-th of that,
    # which is the formula search/stages/pipeline_step.py prices
    assert plain - work == pytest.approx((stages - 1) * 3.0)
    assert inter - work == pytest.approx((stages - 1) * 3.0 / virtual)


def test_in_flight_is_what_the_search_prices() -> None:
    # 1F1B: stage s keeps min(p - s, M) micro-batches
    assert in_flight("1f1b", 4, 8) == [[4], [3], [2], [1]]
    assert in_flight("gpipe", 2, 3) == [[3], [3]]
    table = in_flight("interleaved-1f1b", 4, 8, 2)
    # rank 0 runs 2 (p - 1) + (v - 1) p = 10 warm-up forwards: all 8 of chunk 0 are alive
    # before chunk 1's first backward, which is Megatron's extra activation memory
    assert table[0] == [8, 4] and table[3] == [5, 1]
    cfg = Config(stages=8, micro_batches=8, schedule="interleaved-1f1b", virtual=2)
    for k in range(8):
        assert priced_in_flight(cfg, k) == table[k % 4][k // 4]


@pytest.mark.parametrize("args,msg", [
    (("interleaved-1f1b", 4, 6, 2), "not a multiple"),
    (("interleaved-1f1b", 4, 8, 1), ">= 2 virtual stages"),
    (("1f1b", 2, 4, 2), "need schedule 'interleaved-1f1b'"),
    (("none", 2, 4, 1), "needs one stage"),
])
def test_shapes_a_schedule_cannot_run(args, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        check(*args)


def test_pricing_matches_the_schedule_for_equal_chunks() -> None:
    """search/stages/pipeline_step.py's interleaved step (M times the slowest rank plus the fill and
    drain over v) is the list schedule's makespan when every layer costs the same."""
    from autopar.search.stages.layer_stats import LayerStat
    from autopar.search.stages.pipeline_step import price

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(1,))
    stats = [LayerStat(key=f"blocks.{i}", seconds=3e-3, forward=1e-3, compute=3e-3,
                       activations=1.0, out_bytes=1.0, buffers=0.0, params=[])
             for i in range(8)]
    no_link = lambda b: 0.0  # noqa: E731
    for v in (1, 2):
        sched = "interleaved-1f1b" if v > 1 else "1f1b"
        pr = price(stats, Config(stages=4, micro_batches=8, schedule=sched, virtual=v), mesh, no_link, 1e12, "sgd")
        assert pr.feasible
        chunk = 8 / 4 * 3e-3 / v  # two layers per rank, in v chunks
        makespan = max(t.end for t in list_schedule(
            sched, 4, 8, v, lambda s, a, c=chunk: c * (1 / 3 if a.op == "F" else 2 / 3)))
        tail = max(sp.extra for sp in pr.stages)
        assert pr.step_seconds - tail == pytest.approx(makespan, rel=1e-9)
        if v > 1:
            # each rank holds chunks r and r + 4: layers {r, r + 4}
            assert pr.virtual == [[f"blocks.{i}"] for i in range(8)]
            assert pr.stages[1].layers == ["blocks.1", "blocks.5"]


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_zero_bubble_leaves_a_third_of_the_bubble(stages, micro) -> None:
    """With F = B = W (the backward twice the forward, half of it for weights), the
    schedule's step is 3M + (p - 1): a third of 1F1B's 3 (p - 1) bubble, which is what
    search/stages/pipeline_step.py prices (ZERO_BUBBLE_SHARE); its memory is priced from the order."""
    from autopar.plans.schedules import waiting_w
    from autopar.search.stages.step_terms import ZERO_BUBBLE_SHARE

    zb = max(t.end for t in list_schedule("zero-bubble", stages, micro, 1, lambda s, a: 1.0))
    assert zb - 3.0 * micro == pytest.approx(3.0 * (stages - 1) * ZERO_BUBBLE_SHARE)
    # a micro-batch's activations live until its W: at most 2p - 1 on the first stage,
    # and at most p waiting between B and W
    table = in_flight("zero-bubble", stages, micro)
    assert max(r[0] for r in table) <= min(2 * stages - 1, micro)
    assert max(waiting_w(stages, micro)) <= stages
    cfg = Config(stages=stages, micro_batches=micro, schedule="zero-bubble")
    assert [priced_in_flight(cfg, s) for s in range(stages)] == [r[0] for r in table]


def _simulated(schedule: str, stages: int, micro: int, virtual: int) -> tuple:
    """The in-flight peaks per rank and chunk counted from the schedule's actions."""
    from autopar.plans.schedules import actions

    frees = "W" if schedule == Schedule.ZERO_BUBBLE.value else "B"
    out = []
    for s in range(stages):
        alive, peak = [0] * virtual, [0] * virtual
        for a in actions(schedule, s, stages, micro, virtual):
            alive[a.chunk] += {"F": 1, frees: -1}.get(a.op, 0)
            peak[a.chunk] = max(peak[a.chunk], alive[a.chunk])
        out.append(tuple(peak))
    return tuple(out)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_in_flight_counts_settle_so_many_micro_batches_are_not_simulated(stages: int) -> None:
    """From 2 p v micro-batches on the tables are taken at 2 p v (Megatron 145.6B's
    search asks for 2,304): the schedules' own actions give the same counts."""
    from autopar.plans.schedules import _zero_bubble, in_flight_table, waiting_w

    zb = Schedule.ZERO_BUBBLE.value
    for micro in range(2 * stages, 8 * stages + 1):
        assert in_flight_table(zb, stages, micro) == _simulated(zb, stages, micro, 1)
        peaks = []
        for order in _zero_bubble(stages, micro):
            n = peak = 0
            for a in order:
                n += {"B": 1, "W": -1}.get(a.op, 0)
                peak = max(peak, n)
            peaks.append(peak)
        assert waiting_w(stages, micro) == tuple(peaks)
    il = Schedule.INTERLEAVED.value
    for v in (2, 4):
        for micro in range(2 * stages * v, 8 * stages * v + 1, stages):
            assert in_flight_table(il, stages, micro, v) == _simulated(il, stages, micro, v)
