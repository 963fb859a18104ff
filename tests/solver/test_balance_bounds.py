"""Bounds from whole layers: a pipeline's slowest stage takes at least the best balance
of its layers' floors (:func:`autopar.search.stages.split_search.balanced_floor`), and the
bound that skips a split before its intra-op search
(:func:`autopar.search.stages.pipeline_step.split_lower_bound`) allows for every schedule the split
may run: zero-bubble and interleaving leave less of the fill and drain than 1F1B, and
the search once charged 1F1B's to all of them."""

from __future__ import annotations

import math
import random
import sys
import warnings
from pathlib import Path

from autopar import MeshSpec
from autopar.plans.decisions import PlanOptions
from autopar.plans.kinds import Schedule
from autopar.search.joint import JointSearch
from autopar.search.space import _Candidate
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.pipeline_step import price, split_lower_bound, step_lower_bound
from autopar.search.stages.priced import Config, Priced
from autopar.search.stages.split_search import balanced_floor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

MESH = MeshSpec.preset("multinode-a100-ib", shape=(4, 2))


def _least_largest(floors: list[float], parts: int) -> float:
    """The least largest range sum over splits into exactly ``parts`` ranges: every split."""
    n = len(floors)
    pre = [0.0]
    for f in floors:
        pre.append(pre[-1] + f)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for s in range(1, parts + 1):
        for j in range(1, n + 1):
            best[s][j] = min((max(best[s - 1][i], pre[j] - pre[i]) for i in range(j)), default=math.inf)
    return best[parts][n]


def test_balanced_floor_is_the_best_balance_from_below() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 14)
        floors = [rng.choice([0.0, rng.uniform(0.0, 3.0), 1.0]) for _ in range(n)]
        for parts in range(1, n + 1):
            exact = _least_largest(floors, parts)
            got = balanced_floor(floors, parts)
            # never over the exact answer (a bound), and within the bisection's tolerance
            # of it (could be false: a bound of the average alone is up to 2x under)
            assert got <= exact
            assert got >= exact * (1 - 1e-8) - 1e-12, (floors, parts, got, exact)
    # stacks of identical layers between a first and a last one (the greedy packs a
    # run of equal floors at once): the same guarantees
    for _ in range(60):
        k = rng.randint(1, 30)
        floors = [rng.uniform(0.0, 3.0)] + [rng.choice([0.1, 1.0 / 3, rng.uniform(0.0, 1.0)])] * k \
            + [rng.uniform(0.0, 3.0)]
        for parts in range(1, len(floors) + 1):
            exact = _least_largest(floors, parts)
            got = balanced_floor(floors, parts)
            assert exact * (1 - 1e-8) - 1e-12 <= got <= exact, (floors, parts, got, exact)
    # 80 equal layers on 24 stages: some stage holds 4 (the average is 3.33)
    assert math.isclose(balanced_floor([1.0] * 80, 24), 4.0, rel_tol=1e-8)
    assert balanced_floor([1.0, -0.5], 2) == -math.inf  # no bound from negative floors


def _ideal(n: int, seconds: float) -> list[LayerStat]:
    """Layers that compute at their floor: no communication, no memory to speak of."""
    return [LayerStat(key=f"layers.{k}", seconds=seconds, forward=seconds / 3, compute=seconds,
                      activations=1.0, out_bytes=1.0, floor=seconds) for k in range(n)]


def test_bounds_stay_under_every_schedule_of_ideal_layers() -> None:
    """On layers at their floor the bounds are nearly tight, so a bound that charges a
    schedule more fill than it has is over its price: the split bound before
    ``shapes`` was, for zero-bubble (the full fill against a third of it)."""
    stats, link = _ideal(12, 0.01), (lambda b: 0.0)
    floors = [st.seconds for st in stats]
    for p, m in ((2, 4), (4, 8), (3, 6), (4, 4)):
        for sched, v in ((Schedule.ONE_F_ONE_B, 1), (Schedule.ZERO_BUBBLE, 1),
                         (Schedule.INTERLEAVED, 2), (Schedule.GPIPE, 1)):
            cfg = Config(stages=p, micro_batches=m, schedule=sched.value, virtual=v)
            pr = price(stats, cfg, MESH, link, math.inf, "adamw")
            assert pr.feasible
            lb = split_lower_bound(floors, p, m, MESH.idle_reuse, [(1.0 / v if v > 1 else {
                Schedule.ZERO_BUBBLE: 1.0 / 3.0}.get(sched, 1.0), v)])
            assert lb <= pr.step_seconds * (1 + 1e-12), (p, m, sched, lb, pr.step_seconds)
            assert step_lower_bound(stats, cfg, MESH, link, "adamw") <= pr.step_seconds * (1 + 1e-12)
            if sched == Schedule.ZERO_BUBBLE:
                # the old split bound: the compute over every device, 1F1B's whole fill
                old = sum(floors) / p * (m + p - 1)
                assert old > pr.step_seconds  # the reason for shapes
    # 7 equal layers on 3 stages: the slowest holds 3 (the average bound says 2.33)
    cfg = Config(stages=3, micro_batches=6, schedule=Schedule.ONE_F_ONE_B.value)
    seven = _ideal(7, 0.01)
    pr = price(seven, cfg, MESH, link, math.inf, "adamw")
    assert step_lower_bound(seven, cfg, MESH, link, "adamw") >= 0.03 * 6 * (1 - 1e-9)
    assert step_lower_bound(seven, cfg, MESH, link, "adamw") <= pr.step_seconds * (1 + 1e-12)


def test_search_does_not_skip_a_split_only_zero_bubble_wins() -> None:
    """A split whose zero-bubble config beats the plan in hand is searched: the old
    bound (1F1B's fill for every schedule) skipped it."""
    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=32, batch=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        js = JointSearch(model, ex, MESH, PlanOptions(explore=True))
    devices, p, m = math.prod(MESH.shape), 4, 4
    # the plain candidate's layers: 12 equal ones at their floor on every device
    known = _ideal(12, 0.01)
    for st in known:
        st.floor = st.seconds * devices
    plain = _Candidate(1, 1, None, None, known, MESH)  # type: ignore[arg-type]
    # per micro-batch, on a stage's devices: the split's own layers
    split = _ideal(12, 0.01 * p / m)
    zb = price(split, Config(stages=p, micro_batches=m, schedule=Schedule.ZERO_BUBBLE.value), MESH, lambda b: 0.0, math.inf, "adamw")
    old = sum(st.floor for st in known) / devices * (m + p - 1) / m
    best = 0.5 * (zb.step_seconds + old)  # between the two
    assert zb.step_seconds < best < old
    js.priced = [(plain, Priced(Config(), [], best, 0.0))]
    js.priced[0][1].stages = zb.stages  # feasible: a plan in hand at ``best``
    assert js.best() is not None
    assert not js._bounded(p, m, False)  # searched: zero-bubble may win
    # and a split whose compute alone is over the best is still skipped
    js.priced[0][1].step_seconds = zb.step_seconds * 0.5
    js._best_seen.clear()
    assert js._bounded(p, m, False)
