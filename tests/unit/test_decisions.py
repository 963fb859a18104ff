"""The decision registry (autopar/plans/decisions.py) against everything that must agree
with it: the JSON fields of ``Decisions``, the fields of ``PlanOptions``, the keywords
``autopar.plan`` and ``auto_parallel`` take, the functions each entry names and the
``plan.explain`` texts the search writes for its key.  A decision added to one of them
and not to the registry fails here."""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import fields

import pytest

import autopar
from autopar import MeshSpec
from autopar.api import _DECISION_KEYS
from autopar.errors import ConfigError
from autopar.plans.decisions import (
    DECISIONS,
    RESULT_FIELDS,
    SEARCH_KNOBS,
    Decisions,
    PlanOptions,
    decision_options,
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
        assert not named & options, f"{fn.__name__} names a decision outside **decisions"
        assert REQUEST - {"choose_limit"} <= named | {"search", "time_limit"}


@pytest.mark.parametrize("decision", DECISIONS, ids=lambda d: d.name)
def test_entry_names_functions_that_exist(decision) -> None:
    for ref in (decision.price, decision.apply):
        module, name = ref.split(":")
        assert callable(getattr(importlib.import_module(module), name)), ref


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
