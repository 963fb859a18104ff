"""Bad input gets a clear autopar error up front, naming the argument, the value and
what is allowed (issue "Nothing lost, nothing silent").  Before: ``mesh="-2"`` said
"unknown mesh preset '-2'", a malformed mesh JSON file gave a bare JSONDecodeError,
pins "S(x)" / "S(0" gave ``invalid literal for int()`` / ``substring not found``, a
negative memory budget was searched and then "no plan fits -5 B", a meta-device model
was accepted and failed at its first forward, a second identical plan showed no
fallback warning, and Python state changed by the forward was frozen silently.

``CASES`` is also what benchmarks/reliability_api.py times for docs/reliability.md."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import AutoparWarning, ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mlp  # noqa: E402


def _bad_json(tmp: Path) -> str:
    p = tmp / "mesh.json"
    p.write_text('{"shape": [2,')
    return str(p)


# id -> (keyword arguments of autopar.plan, words the message must contain)
CASES = {
    "mesh '-2'": ({"mesh": "-2"}, ["mesh='-2'", "positive"]),
    "mesh 'nope' (no such preset)": ({"mesh": "nope"}, ["mesh='nope'", "presets:"]),
    "mesh '2x0'": ({"mesh": "2x0"}, ["mesh='2x0'"]),
    "mesh file missing": ({"mesh": "/nonexistent/mesh.json"}, ["no such file"]),
    "mesh file not JSON": ({"mesh": "BAD_JSON"}, ["not valid JSON", "line 1"]),
    "mesh JSON not a mesh": ({"mesh": '{"shape": "x"}'}, ["not a mesh description"]),
    "pin 'S(x)'": ({"pins": {"fc1.weight": "S(x)"}}, ["pins['fc1.weight']='S(x)'", "S(dim)"]),
    "pin 'S(0'": ({"pins": {"fc1.weight": "S(0"}}, ["'S(0'", "placement string"]),
    "pin not a string": ({"pins": {"fc1.weight": 3}}, ["pins['fc1.weight']=3"]),
    "pins not a dict": ({"pins": ["fc1.weight"]}, ["pins=['fc1.weight']"]),
    "memory_budget -5": ({"memory_budget": -5}, ["memory_budget", "-5"]),
    "time_limit 0": ({"time_limit": 0}, ["time_limit", "0"]),
    "search 'fast'": ({"search": "fast"}, ["search", "'fast'", "ilp"]),
    "zero_stage 4": ({"zero_stage": 4}, ["zero_stage", "4"]),
    "micro_batches 0": ({"micro_batches": 0}, ["micro_batches", "0"]),
    "pipeline_stages 1.5": ({"pipeline_stages": 1.5}, ["pipeline_stages", "1.5"]),
    "schedule 'zb'": ({"schedule": "zb"}, ["schedule", "'zb'", "1f1b"]),
    "recompute 'blocks.0' (a string)": ({"recompute": "blocks.0"}, ["recompute", "list"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_clear_error(case, tmp_path):
    kw, words = CASES[case]
    if kw.get("mesh") == "BAD_JSON":
        kw = {**kw, "mesh": _bad_json(tmp_path)}
    kw = {"mesh": (2,), **kw}
    model, ex = mlp.build()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        autopar.plan(model, ex, **kw)
    assert time.perf_counter() - t0 < 2.0  # before capture and search
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_timeout_is_validated():
    model, ex = mlp.build()
    with pytest.raises(ConfigError, match="timeout"):
        autopar.auto_parallel(model, example_inputs=ex, mesh=(2,), timeout=-1)


def test_meta_model_is_refused_before_running():
    from autopar.api import build_parallel_module
    from autopar.plans.decisions import PlanOptions

    with torch.device("meta"):
        model, _ = mlp.build()
    ex = (torch.randn(16, 64), torch.randn(16, 8))
    # planning a meta model is fine (plans for clusters you do not have)
    autopar.plan(model, tuple(x.to("meta") for x in ex), (2,))
    with pytest.raises(ConfigError, match="meta device"):
        build_parallel_module(model, ex, autopar.MeshSpec.preset("cpu-gloo", shape=(2,)),
                              PlanOptions(), runtime=True)


def test_fallback_warnings_every_plan():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.cummax(self.fc(x), 1)[0].sum()  # no sharding rule

    for _ in range(2):  # before: the second identical plan reported nothing
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            p = autopar.plan(M(), (torch.randn(4, 8),), (2,))
        assert any("cummax" in w for w in p.warnings)
        assert any(issubclass(w.category, AutoparWarning) and "cummax" in str(w.message) for w in caught)


def test_forward_changing_python_state_warns_and_is_restored():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.fc(x).sum() * self.calls

    m = Counter()
    p = autopar.plan(m, (torch.randn(4, 8),), (2,))
    assert any("calls (0 -> 1)" in w for w in p.warnings)
    assert m.calls == 0


def test_forward_changing_containers_and_tensors_warns():
    # before: only numbers and strings were compared, so a list the forward appends to
    # (the loss scaled by len(self.hist): 1.75, 3.50, 5.25 in eager, 1.75 three times in
    # the plan) and a tensor it stashes changed silently
    class Hist(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.hist: list[int] = []
            self.seen: dict[str, int] = {}

        def forward(self, x):
            self.hist.append(1)
            self.seen["calls"] = len(self.hist)
            self.last = x.detach()
            return self.fc(x).sum() * len(self.hist)

    m = Hist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        p = autopar.plan(m, (torch.randn(4, 8),), (2,))
    text = " ".join(p.warnings)
    assert "hist (a list of 0 -> a list of 1)" in text
    assert "seen (a dict of 0 -> a dict of 1)" in text
    assert "last (unset -> a tensor)" in text
    assert any(issubclass(w.category, AutoparWarning) and "hist" in str(w.message) for w in caught)


def test_forward_reading_state_without_changing_it_is_quiet():
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.weights = [0.5, 2.0]
            self.table = torch.ones(8)

        def forward(self, x):
            return self.fc(x * self.table).sum() * self.weights[1]

    p = autopar.plan(Reads(), (torch.randn(4, 8),), (2,))
    assert not any("Python state" in w for w in p.warnings)
