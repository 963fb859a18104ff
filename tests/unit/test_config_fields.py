"""The joint search's :class:`~autopar.search.stages.priced.Config` against the decision
registry (:data:`autopar.plans.decisions.DECISIONS`): every field a decision records has
the Config field that decides it (or is listed, with the reason, as set after the
search), so a searched decision added to the registry without its Config field fails
here; and the values the options force reach every config by the registry's keywords."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from autopar.plans.decisions import (
    DECISIONS,
    Decision,
    Option,
    PlanOptions,
    decision_fields,
    decision_options,
)
from autopar.plans.option_checks import flag
from autopar.search.stages import priced
from autopar.search.stages.priced import (
    AFTER_SEARCH,
    DECIDED_BY,
    PASSED_THROUGH,
    Config,
    choice_fields,
    chosen_fields,
    forced_fields,
)

CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


@pytest.mark.parametrize("name", decision_fields())
def test_every_recorded_field_has_a_config_field_or_a_reason(name: str) -> None:
    assert (name in DECIDED_BY) != (name in AFTER_SEARCH), \
        f"Decisions.{name}: give it a Config field (DECIDED_BY) or a reason (AFTER_SEARCH), once"
    if name in DECIDED_BY:
        assert DECIDED_BY[name] in CONFIG_FIELDS, f"Config has no field {DECIDED_BY[name]!r}"
    else:
        assert AFTER_SEARCH[name].strip(), f"Decisions.{name}: no reason given"


def test_no_entry_outlives_its_registry_field() -> None:
    assert set(DECIDED_BY) | set(AFTER_SEARCH) == set(decision_fields())


def test_every_config_field_decides_something() -> None:
    # one Config field per decided field: two Decisions fields on one Config field
    # would make one of them a copy of the other
    assert sorted(DECIDED_BY.values()) == sorted(CONFIG_FIELDS)


def test_passed_through_decisions_have_one_keyword_and_one_field() -> None:
    by_name = {d.name: d for d in DECISIONS}
    for name in PASSED_THROUGH:
        d = by_name[name]
        assert len(d.options) == 1 and len(d.fields) == 1, d
        assert d.options[0].name in decision_options()


def test_forced_values_reach_every_config_by_keyword() -> None:
    forced = PlanOptions(recompute=("blocks.0",), reshard_after_forward=True, bucket_bytes=2 ** 20,
                         keep_grad_buffers=False, split_gathers=True)
    got = forced_fields(forced)
    assert got == {"recompute": ("blocks.0",), "reshard": True, "bucket_bytes": 2 ** 20,
                   "keep_buffers": False, "split_gathers": True}
    # searched (None) stays None: the stages' pricing chooses
    assert set(forced_fields(PlanOptions()).values()) == {None}
    cfg = Config(stages=2, micro_batches=4, **got)
    assert (cfg.reshard, cfg.keep_buffers, cfg.split_gathers) == (True, False, True)


def test_config_is_built_by_keyword() -> None:
    with pytest.raises(TypeError):
        Config(2, 4)  # type: ignore[misc]


def test_decisions_with_choices_have_one_keyword_and_one_field() -> None:
    for d in DECISIONS:
        if d.choices:
            assert len(d.options) == 1 and len(d.fields) == 1, d
            assert d.fields[0] in DECIDED_BY, f"{d.name}: its Config field goes in DECIDED_BY"


def test_choices_reach_the_configs_and_the_chosen_one_the_plan(monkeypatch) -> None:
    """A decision with choices is priced once per choice unless forced, and the plan
    records the config's value: a trial entry on ``copies``'s Config field, so no field
    has to be made up (the registry's own entries with choices left out)."""
    trial = Decision("trial", "a trial", (Option("trial", flag, "a trial"),), ("copies",),
                     choices=(1, 2))
    plain = tuple(d for d in DECISIONS if not d.choices)
    monkeypatch.setattr(priced, "DECISIONS", plain)
    assert choice_fields(PlanOptions()) == [{}]  # one config each, as before choices
    monkeypatch.setattr(priced, "DECISIONS", (*plain, trial))
    assert choice_fields(SimpleNamespace(trial=None)) == [{"copies": 1}, {"copies": 2}]
    assert choice_fields(SimpleNamespace(trial=2)) == [{"copies": 2}]
    assert chosen_fields(Config(copies=2)) == {"copies": 2}
