"""The explanations of the chosen plan compare it with the best alternative the search
saw (:mod:`autopar.search.why`)."""

from __future__ import annotations

import math

from autopar.search.stages.priced import Config, Priced
from autopar.search.why import Context, _alt, _versus


def _ctx(*priced: Priced) -> Context:
    return Context([(None, p) for p in priced], set(), 1e12, 8, "adamw")


def test_a_bound_below_every_priced_step_is_what_the_alternative_is_said_to_take() -> None:
    # a pipelined config cut by its bound (7 ms at least) may be faster than the one
    # priced in full (8 ms): "pipelining takes 8 ms" would overstate it
    pipe = Config(stages=2, micro_batches=4, schedule="1f1b")
    full = Priced(pipe, [], 8e-3, 1e9)
    cut = Priced(Config(stages=2, micro_batches=8, schedule="1f1b"), [], math.inf, math.inf,
                 bound=7e-3)
    text = _versus(_ctx(full, cut), _alt(_ctx(full, cut), lambda c: c.stages > 1), "pipelining")
    assert text.startswith("pipelining takes at least 7.000 ms"), text


def test_a_bound_above_the_best_priced_step_leaves_the_priced_one() -> None:
    full = Priced(Config(stages=2, micro_batches=4, schedule="1f1b"), [], 8e-3, 1e9)
    cut = Priced(Config(stages=2, micro_batches=8, schedule="1f1b"), [], math.inf, math.inf,
                 bound=9e-3)
    alt = _alt(_ctx(full, cut), lambda c: c.stages > 1)
    assert alt is full
