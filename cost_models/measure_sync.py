"""What calibration times between the ranks of a step, beside their compute rates
(:mod:`.measure`): how much of a collective hides beside compute (``overlap``), how much
of a pipeline bubble ranks sharing cores win back (``idle_reuse``), how far the slowest
rank lags the mean (``straggler``) and what a blocking collective waits out beyond its
price (``sync_seconds``).

Each is collective over its group, as :mod:`.measure` is, and returns numbers identical
on every rank; each has a pure ``*_estimate`` (or the arithmetic inline) that unit tests
pin against recorded rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .measure import (
    Sync,
    _rate,
    iqr,
    matmul_block,
    max_over_ranks,
    mean_over_ranks,
    median,
    timed_rounds,
    timed_samples,
)

__all__ = ["collective_pairing", "idle_reuse", "overlap_estimate", "overlap_fraction", "straggler", "sync_estimate",
           "sync_penalty"]


def loop_count(fn: Callable[[], Any], seconds: float, calls: int, repeats: int, sync: Sync,
               group: Any, device: Any) -> int:
    """How many calls of ``fn`` last about ``seconds``, the same count on every rank of
    ``group`` (the MAX, so every rank computes as long as the others).  One call is
    timed as the fastest of ``max(repeats, 5)`` samples of ``calls`` calls in a row (one
    call alone times the timer and a cold start), over ``calls``.  The fastest, not the
    median: on a loaded host the scheduler preempts a sample now and then for
    milliseconds, and a loop sized from the median of such samples came out a few calls
    long (the drift's 2 ms chunk of 64x64 matmuls ran 10 us with three more busy
    processes on 2 cores, every time).  No barrier between samples: a rank woken from
    one is the likeliest to be preempted next."""
    one = min(timed_samples(lambda: [fn() for _ in range(calls)], max(repeats, 5), sync)) / calls
    return max(1, int(max_over_ranks([seconds / max(one, 1e-9)], group, device)[0]))


def overlap_fraction(group: Any, nbytes: int, device: Any, dtype: Any, mm_n: int,
                     repeats: int, sync: Sync, job: Any = None) -> dict[str, float]:
    """``MeshSpec.overlap`` fitted to a measurement in the terms the bucket model uses.

    ``A``: an ``nbytes`` all-reduce alone; ``C``: matmuls alone, about ``A / 2`` of them;
    ``T``: the all-reduce started asynchronously, the same matmuls, then its wait.  The
    model (:func:`autopar.search.buckets._end`) says a reduction runs at ``overlap`` of its
    speed while compute lasts and at full speed after, and compute is not slowed, so
    ``T = C + A - C * overlap`` while ``C < A``; hence ``overlap = (C + A - T) / C``.  On
    GPUs ``T ~ A`` (overlap 1); where ranks share cores, communication also takes the
    compute's cycles and ``T`` nears ``C + A`` (overlap near 0)."""

    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    a = torch.randn(mm_n, mm_n, dtype=dtype, device=device)
    b = torch.randn(mm_n, mm_n, dtype=dtype, device=device)

    def bar() -> None:
        dist.barrier(group=group)

    alone = median(timed_samples(lambda: dist.all_reduce(buf, group=group), repeats, sync, bar))
    k = loop_count(lambda: torch.mm(a, b), alone / 2, 16, repeats, sync, group, device)

    def compute() -> None:
        for _ in range(k):
            torch.mm(a, b)

    def both() -> None:
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    # A, C and T side by side in each round (A C T A C T ...), each round's fraction from
    # its own three times (overlap_estimate: the median over rounds less two standard
    # errors): load that comes and goes then touches the three alike, where three
    # medians taken one after the other let it move the fraction between calibrations
    # of the same idle host (and with it every reduction hidden behind a backward).
    a_t, c_t, t_t = timed_rounds([lambda: dist.all_reduce(buf, group=group), compute, both],
                                 repeats, sync, bar)
    # over the whole job (``job``, default the world): ``group`` may be one of a mesh
    # axis' groups, and every rank must derive the same overlap; per round, the slowest
    # rank's times (every rank waits for it)
    worst = max_over_ranks([*a_t, *c_t, *t_t], job, device)
    n = len(a_t)
    a_t, c_t, t_t = worst[:n], worst[n:2 * n], worst[2 * n:]
    return {**overlap_estimate(a_t, c_t, t_t), "alone": median(a_t),
            "compute": median(c_t), "both": median(t_t)}


def collective_pairing(group: Any, device: Any, repeats: int, sync: Sync, job: Any = None,
                       nbytes: int = 4096, pairs: int = 16) -> dict[str, float]:
    """``MeshSpec.collective_pairing``: the share of a small collective's time that a
    second one in flight on the same group at once saves.  Side by side in each of
    ``repeats`` rounds: ``S``, ``pairs`` times two ``nbytes`` all-reduces one after the
    other; ``P``, ``pairs`` times the two issued asynchronously and then waited.  Per
    round ``(S - P) / (S / 2)``, the slowest rank's times, clamped to [0, 1]; the median
    over rounds.  Sixteen pairs a round because fewer scatter: on 4 gloo ranks of a
    2-core host one pair a round gave 0.0-0.86 over five runs, sixteen 0.48-0.56.  A backend
    that runs a group's collectives one at a time (NCCL's stream per communicator)
    gives 0; gloo's worker threads run two at once (multi-copy overlap's twin
    collectives, :func:`autopar.search.stages.step_terms.copies_hidden`)."""

    one = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    two = torch.ones_like(one)

    def bar() -> None:
        dist.barrier(group=group)

    def seq() -> None:
        for _ in range(pairs):
            dist.all_reduce(one, group=group)
            dist.all_reduce(two, group=group)

    def par() -> None:
        for _ in range(pairs):
            w = dist.all_reduce(one, group=group, async_op=True)
            dist.all_reduce(two, group=group, async_op=True).wait()
            w.wait()

    s_t, p_t = timed_rounds([seq, par], repeats, sync, bar)
    worst = max_over_ranks([*s_t, *p_t], job, device)
    n = len(s_t)
    shares = [min(1.0, max(0.0, (s - p) / (s / 2.0))) for s, p in zip(worst[:n], worst[n:]) if s > 0]
    return {"collective_pairing": median(shares) if shares else 0.0,
            "sequential": median(worst[:n]), "paired": median(worst[n:])}


def overlap_estimate(alone: Sequence[float], compute: Sequence[float],
                     both: Sequence[float], bound: float = 2.0) -> dict[str, float]:
    """``MeshSpec.overlap`` from rounds of :func:`overlap_fraction`'s three times: each
    round's fraction ``(C + A - T) / C``, their median, the median's standard error
    (``1.2533 sigma / sqrt(n)``, sigma from the interquartile range), and ``overlap``:
    the median less ``bound`` standard errors, within [0.02, 1] -- the overlap the
    rounds show, not one that noise alone could have given.

    Why a bound and not the median: where ranks share cores a round's fraction is a
    difference of times a few ms long and scatters from -2.5 to +0.8 around a true
    value near 0 (4 ranks on 2 cores), so a median of 15 rounds can come out 0.1-0.5 and
    hide gradient reductions the backward never hides; such medians lie about two
    standard errors from zero, hence ``bound = 2``.  On a GPU
    the rounds agree (``T ~ A``, each fraction near 1), the error is small and the bound
    is the median.  Clamped below at 0.02: beside compute a collective is never faster,
    and a measurement slower than both in series still leaves it a sliver
    (MeshSpec.overlap must be > 0)."""
    if not (len(alone) == len(compute) == len(both)) or not alone:
        raise ValueError("overlap_estimate needs as many alone, compute and both times, at least one")
    fractions = [(c + a - t) / c if c > 0 else 1.0 for a, c, t in zip(alone, compute, both)]
    mid = median(fractions)
    err = 1.2533 * iqr(fractions) / 1.349 / math.sqrt(len(fractions))
    return {"overlap": min(1.0, max(0.02, mid - bound * err)), "median": mid, "stderr": err}


def idle_reuse(group: Any, device: Any, dtype: Any, n: int, min_seconds: float,
               sync: Sync) -> dict[str, float]:
    """``MeshSpec.idle_reuse``: the share of a pipeline's fill and drain that ranks sharing
    cores win back, from how much faster half the ranks compute while the other half
    wait (as idle stages wait in recv).  With ``r = half / all`` (the mean matmul rate per
    computing rank, half busy over every rank busy; the mean, not the slowest: the bubble
    is a matter of throughput, and the slowest of 4 ranks on 2 cores is unfair
    scheduling's noise), the reuse is ``2 (1 - 1 / r)``: the pipeline prices the bubble
    as the other stages' work at the every-rank-busy rate times ``1 - reuse``, and where
    only one of two stages runs at a time (one micro-batch) the step is the two stages'
    work at the half-busy rate, ``2 / r`` of one stage's priced time, so ``1 + (1 -
    reuse) = 2 / r``.  In [0, 0.95]: 0 where every rank has a device of its own
    (``r = 1``), the cap for 4 ranks on 2 cores (``r = 2``: the cores never idle, the
    bubble costs nothing)."""

    p = dist.get_world_size(group)
    if p < 2:
        return {"idle_reuse": 0.0, "all": 0.0, "half": 0.0}
    me = dist.get_rank(group)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    dist.barrier(group=group)
    every = _rate(lambda: torch.mm(a, b), 2.0 * n**3, min_seconds, sync)
    dist.barrier(group=group)
    # the second half waits in the barrier below (blocked, as an idle stage waits in recv)
    half = _rate(lambda: torch.mm(a, b), 2.0 * n**3, min_seconds, sync) if me < p // 2 else 0.0
    dist.barrier(group=group)
    mean_all, half_share = mean_over_ranks([every, half], group, device)
    mean_half = half_share * p / (p // 2)  # the waiting ranks counted 0
    reuse = 2.0 * (1.0 - mean_all / mean_half) if mean_half > 0 else 0.0
    return {"idle_reuse": min(0.95, max(0.0, reuse)), "all": mean_all, "half": mean_half}
def straggler(group: Any, device: Any, dtype: Any, d: int, tokens: int, repeats: int,
              sync: Sync, window: float = 0.05, job: Any = None) -> dict[str, float]:
    """``MeshSpec.straggler``: the slowest rank's time for about ``window`` seconds of a
    training layer's work (:func:`matmul_block` forward and backward on ``tokens`` rows
    of width ``d``, the same count on every rank) over the ranks' mean, in each of
    ``repeats`` rounds after a barrier; the median over rounds, at least 1.

    The rates :func:`compute_rates` measures are the ranks' mean, which is what every
    rank gets over a long run; but a synchronous step goes at its slowest rank's pace
    between collectives, and where ranks share cores the scheduler is unfair over tens
    of milliseconds (4 gloo ranks on 2 cores: 1.04 at 50 ms, 1.11-1.14 at 15 ms; 1.12
    and 1.21-1.29 with one more busy process).  On a GPU per rank it is about 1."""

    blk = matmul_block(d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
    seed = torch.ones(tokens, d, device=device, dtype=dtype)

    def layer() -> None:
        blk(x).backward(seed)

    def bar() -> None:
        dist.barrier(group=group)

    k = loop_count(layer, window, 4, 3, sync, group, device)
    (times,) = timed_rounds([lambda: [layer() for _ in range(k)]], repeats, sync, bar)
    job = job if job is not None else group
    worst = max_over_ranks(times, job, device)
    mean = mean_over_ranks(times, job, device)
    ratios = [w / m for w, m in zip(worst, mean) if m > 0]
    return {"straggler": max(1.0, median(ratios)) if ratios else 1.0, "window": median(mean)}


def sync_penalty(group: Any, device: Any, dtype: Any, mm_n: int, repeats: int, sync: Sync,
                 job: Any = None, chunk_seconds: float = 0.01, chain: int = 8,
                 nbytes: int = 4096, alone_samples: int = 4) -> dict[str, float]:
    """``MeshSpec.sync_seconds``: what a blocking collective issued between compute costs
    beyond its price after a barrier.

    Side by side in each of ``repeats`` rounds: ``A``, ``alone_samples`` single
    ``nbytes`` all-reduces, each after a barrier (what the collective curves measure);
    ``C``, ``chain`` chunks of about ``chunk_seconds`` of matmuls; ``T``, the same
    chunks, each followed by a blocking all-reduce, as a tensor-parallel layer runs.
    The penalty is the median over rounds of ``T / chain - C / chain`` less the median
    of every ``A``: ``T`` and ``A`` on the slowest rank (every rank waits for it), ``C``
    the ranks' mean, so the drift beyond the mean compute; at least 0.  See
    :func:`sync_estimate` for why ``A`` is pooled over the rounds and sampled several
    times in each.  ``MeshSpec.straggler`` x ``C`` is not subtracted: the straggler's
    noise between calibrations (1.08-1.25 on 4 gloo ranks of 2 cores) times a chunk is
    as large as the drift, and would zero the penalty.

    Where ranks share cores they drift apart while they compute, and each collective
    waits for the last: 4 gloo ranks on 2 cores paid 3-6 ms per collective beyond its
    5-6 ms after a barrier (chunks of 20-80 ms), so a tensor-parallel step's blocking
    all-reduces cost 1.5-2x their price after a barrier.
    On a GPU the collectives queue behind the kernels on the device and the penalty is
    near 0."""

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    a = torch.randn(mm_n, mm_n, dtype=dtype, device=device)
    b = torch.randn(mm_n, mm_n, dtype=dtype, device=device)

    def bar() -> None:
        dist.barrier(group=group)

    k = loop_count(lambda: torch.mm(a, b), chunk_seconds, 16, repeats, sync, group, device)

    def reduce() -> None:
        dist.all_reduce(buf, group=group)

    def chunks() -> None:
        for _ in range(chain * k):
            torch.mm(a, b)

    def chained() -> None:
        for _ in range(chain):
            for _ in range(k):
                torch.mm(a, b)
            dist.all_reduce(buf, group=group)

    *a_ts, c_t, t_t = timed_rounds([reduce] * max(1, alone_samples) + [chunks, chained],
                                   repeats, sync, bar)
    a_t = [t for ts in a_ts for t in ts]
    worst = max_over_ranks([*a_t, *t_t], job, device)
    # over the whole job (default the world), as the MAX above: ``group`` may be one of
    # several axis groups, and every rank must derive the same penalty
    mean_c = mean_over_ranks(c_t, job, device)
    return sync_estimate(worst[:len(a_t)], mean_c, worst[len(a_t):], chain)


def sync_estimate(alone: Sequence[float], compute: Sequence[float], chained: Sequence[float],
                  chain: int) -> dict[str, float]:
    """:func:`sync_penalty`'s arithmetic: the median over rounds of ``chained / chain -
    compute / chain``, less the median of every ``alone`` sample, at least 0
    (``sync_seconds``); with the medians of the three times per collective and the
    counts of rounds and of ``alone`` samples beside it.

    ``alone`` is pooled rather than paired with its round's chain: a lone 4 KiB
    all-reduce after a barrier varied with a standard deviation of 3-8 ms between rounds
    on 4 gloo ranks of 2 cores with one more busy process, as much as a chain's whole
    drift, and uncorrelated with its round's chain.  Subtracted round by round, its
    noise would come into every round (15 rounds gave one host 1.2-8.8 ms).  Hence
    several samples a round, a pooled median, and more rounds (``calibrate`` takes 60)."""
    if len(compute) != len(chained) or not alone or not compute or chain < 1:
        raise ValueError("sync_estimate needs as many compute as chained times, at least one of "
                         "each and of alone, and chain >= 1")
    rounds = [(t - c) / chain for c, t in zip(compute, chained)]
    return {"sync_seconds": max(0.0, median(rounds) - median(alone)), "alone": median(alone),
            "chunk": median(compute) / chain, "chained": median(chained) / chain,
            "rounds": float(len(rounds)), "alone_samples": float(len(alone))}
