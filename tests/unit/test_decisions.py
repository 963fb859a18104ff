"""The decision registry (autopar/plans/decisions.py) against everything that must agree
with it: the JSON fields of ``Decisions``, the fields of ``PlanOptions``, the keywords
``autopar.plan`` and ``auto_parallel`` take, the price and apply hooks registered for
each entry (and the runtime's steps that call them) and the ``plan.explain`` texts the
search writes for its key.  A decision added to one of them and not to the registry
fails here."""

from __future__ import annotations

import inspect
import sys
from dataclasses import fields

import pytest
from autopar.passes.lower import lower  # what auto_parallel imports to lower a plan

import autopar
import autopar.search.entry  # noqa: F401  (what autopar.plan imports to search: its price hooks)
from autopar import MeshSpec
from autopar.api import _DECISION_KEYS
from autopar.capture.trace import finish_shaped
from autopar.errors import ConfigError
from autopar.module.apply import apply_plan
from autopar.module.parallel import ParallelModule
from autopar.plans.decisions import (
    DECISIONS,
    RESULT_FIELDS,
    SEARCH_KNOBS,
    Decisions,
    PlanOptions,
    applies,
    decision_options,
    forced_values,
    prices,
)
from tests.dist.harness import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import mlp  # noqa: E402

REQUEST = {"memory_budget", "optimizer", "time_limit", "search", "pins", "batch", "choose_limit"}
"""PlanOptions fields that are what the plan is asked for, not a decision."""


def test_every_decisions_field_belongs_to_one_entry() -> None:
    declared = [f for d in DECISIONS for f in d.fields] + list(RESULT_FIELDS)
    assert len(declared) == len(set(declared)), "a field is declared twice"
    assert {f.name for f in fields(Decisions)} == set(declared)


def test_every_forcing_option_is_a_plan_option_and_a_keyword() -> None:
    options = set(decision_options())
    assert {f.name for f in fields(PlanOptions)} == options | set(SEARCH_KNOBS) | REQUEST
    assert set(_DECISION_KEYS) == options | set(SEARCH_KNOBS)
    for fn in (autopar.plan, autopar.auto_parallel):
        named = {p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind is p.KEYWORD_ONLY}
        # auto_parallel's compile=None is resolved by the device it runs on (api.compiles)
        by_name = {"compile"} if fn is autopar.auto_parallel else set()
        assert not named & options - by_name, f"{fn.__name__} names a decision outside **decisions"
        assert REQUEST - {"choose_limit"} <= named | {"search", "time_limit"}


APPLIERS = (apply_plan, ParallelModule.__init__, finish_shaped, lower)
"""Where a plan is applied: the module's steps (:func:`apply_plan`, and the inputs as the
module is built), capture (precision) and lowering (placements, context parallelism)."""

NO_DECISION_STEPS = {"apply_device", "apply_dparams", "apply_unused", "apply_checks"}
"""Steps of :func:`apply_plan` that every plan runs, whatever it decided."""


def calls(fn) -> dict[str, object]:
    """The module-level functions ``fn``'s body names: name -> the object."""
    return {n: fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__}


@pytest.mark.parametrize("decision", DECISIONS, ids=lambda d: d.name)
def test_entry_has_its_hooks_registered(decision) -> None:
    """After the search and lowering are imported, every decision has the function that
    applies it and, unless forced-only, the one that prices it, each registered where it
    is defined (so the function registered is the one that does it)."""
    assert callable(decision.apply), f"no @applies({decision.name!r}) anywhere"
    if not decision.forced_only:
        assert callable(decision.price), f"no @prices({decision.name!r}) anywhere"


def test_forced_only_decisions_record_their_keyword() -> None:
    """A forced-only decision's one keyword is its one field's name, and an unforced
    plan records the same default the plan JSON loads without it."""
    for d in DECISIONS:
        if d.forced_only:
            assert (d.fields, d.choices) == ((d.options[0].name,), ()), d.name
    defaults = {f.name: f.default for f in fields(Decisions)}
    assert forced_values(PlanOptions()) == {f: defaults[f] for f in forced_values(PlanOptions())}
    assert forced_values(PlanOptions(precision="bf16-mixed"))["precision"] == "bf16-mixed"


@pytest.mark.parametrize("decision", DECISIONS, ids=lambda d: d.name)
def test_apply_hook_is_a_step_the_runtime_runs(decision) -> None:
    steps = [f for fn in APPLIERS for f in calls(fn).values()]
    assert any(f is decision.apply for f in steps), \
        f"{decision.apply.__qualname__} applies {decision.name!r} but no step calls it"


def test_every_step_of_apply_plan_is_a_hook_or_runs_always() -> None:
    hooks = {d.apply for d in DECISIONS}
    steps = {n: f for n, f in calls(apply_plan).items() if n.startswith("apply_")}
    assert set(steps) >= NO_DECISION_STEPS
    for name, f in steps.items():
        assert name in NO_DECISION_STEPS or f in hooks, f"{name}: register it with @applies(...)"


@pytest.mark.parametrize("register", [prices, applies])
def test_hook_for_an_unknown_or_hooked_decision_is_refused(register) -> None:
    def stray() -> None:
        """Registered nowhere."""
    with pytest.raises(ValueError, match="no decision 'nonesuch'"):
        register("nonesuch")(stray)
    with pytest.raises(ValueError, match="two .* hooks"):
        register("zero")(stray)  # already registered where zero is priced / applied
    assert stray not in {d.price for d in DECISIONS} | {d.apply for d in DECISIONS}


@pytest.fixture(scope="module")
def searched() -> autopar.Plan:
    return autopar.plan(*mlp.build(), MeshSpec.preset("cpu-gloo", shape=(2,)), search="drec",
                        time_limit=5.0)


@pytest.mark.parametrize("decision", [d for d in DECISIONS if d.explain is not None],
                         ids=lambda d: d.name)
def test_explain_key_reaches_the_search_text(decision, searched) -> None:
    """The key is checked against the real lookup: the texts the search writes
    (``autopar/search/why.py`` into ``Decisions.why``) and what ``plan.explain`` returns."""
    why = searched.decisions.why
    assert decision.explain in why, f"the search writes no why[{decision.explain!r}]: {sorted(why)}"
    assert searched.explain(decision.explain) == why[decision.explain]


def test_explain_takes_every_decision_by_its_keywords_and_fields(searched) -> None:
    """``plan.explainable()`` lists every decision the registry explains, and
    ``plan.explain`` answers each of its keywords and fields with that decision's text
    (the names it listed and took were once hand-kept, without offload, compression,
    copies or gathers)."""
    names = searched.explainable()
    for d in DECISIONS:
        if d.explain is None:
            continue
        assert d.explain in names
        for word in (*(o.name for o in d.options), *d.fields):
            assert searched.explain(word) == searched.decisions.why[d.explain], word


@pytest.mark.parametrize("name", sorted(decision_options()))
def test_every_option_checks_its_value(name) -> None:
    option = decision_options()[name]
    with pytest.raises(ConfigError, match=name):
        option.check(name, object())
