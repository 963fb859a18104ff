"""ZeRO-1/2's gathers after the step in chunks (decision ``gather_chunks``): the front
recurrence of :mod:`autopar.search.gathers` against every way to cut the layers, the
choice between merging and splitting, and the planner taking chunks only where they
price faster and fit."""

from __future__ import annotations

import itertools

import pytest
import torch

import autopar
from autopar import MeshSpec
from autopar.search.gathers import affine, chunk_plan, simulate, stage_chunks
from autopar.search.stages.layer_stats import LayerStat, ParamStat

pytestmark = pytest.mark.filterwarnings("ignore:the model computes")
GLOO = MeshSpec.preset("cpu-gloo", shape=(4,))
GPU = MeshSpec.preset("8xA100-nvlink", shape=(8,))


def _every_cut(n: int):
    for k in range(n):
        for inner in itertools.combinations(range(1, n), k):
            bounds = (0, *inner, n)
            yield list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("mesh", [GLOO, GPU], ids=["gloo", "a100"])
@pytest.mark.parametrize("seed", range(6))
def test_recurrence_is_exact(mesh, seed) -> None:
    """The front's best equals the best of all 2^(n-1) cuts, simulated one by one."""
    g = torch.Generator().manual_seed(seed)
    n = 7
    lat, per = affine(mesh, (0,))
    # bytes around what one latency moves, forward times around one gather's: the
    # regime where merging and splitting trade
    nbytes = (torch.rand(n, generator=g) * 4 * lat / per).tolist()
    fwd = (torch.rand(n, generator=g) * 2 * lat).tolist()
    lead = float(torch.rand(1, generator=g)) * lat
    best = min(simulate(nbytes, fwd, lead, mesh, (0,), c) for c in _every_cut(n))
    cp = chunk_plan(nbytes, fwd, lead, mesh, (0,))
    assert cp.waits == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert simulate(nbytes, fwd, lead, mesh, (0,), list(cp.cuts)) == pytest.approx(cp.waits, rel=1e-9, abs=1e-12)


def test_merges_when_latency_dominates_and_splits_when_bytes_do() -> None:
    lat, per = affine(GPU, (0,))
    tiny = [lat / per / 100] * 6  # each layer's bytes move in 1% of a latency
    assert len(chunk_plan(tiny, [lat / 10] * 6, 0.0, GPU, (0,)).cuts) == 1
    big = [50 * lat / per] * 6  # 50 latencies of bytes, each hidden by the layer before
    cp = chunk_plan(big, [60 * lat] * 6, 0.0, GPU, (0,))
    assert len(cp.cuts) == 6
    # only the first layer's gather is exposed: the others arrive while the one before runs
    assert cp.waits == pytest.approx(lat + per * big[0])


def test_stage_chunks_names_and_lead() -> None:
    """Layers without ZeRO parameters compute in the lead or behind the chunk before."""
    p = lambda name: ParamStat(4e6, (0,), name)  # noqa: E731
    layers = [LayerStat("pre", forward=1e-3),  # no parameters: the lead
              LayerStat("a", forward=1e-3, params=[p("a.w"), p("a.b")]),
              LayerStat("mid", forward=1e-3),
              LayerStat("b", forward=1e-3, params=[p("b.w")]),
              LayerStat("tp", forward=1e-3, params=[ParamStat(4e6, (), "tp.w")])]  # not replicated
    cp = stage_chunks(layers, 2, 0, GLOO)
    assert [n for c in cp.names for n in c] == ["a.w", "a.b", "b.w"]
    assert stage_chunks(layers, 3, 0, GLOO) is None  # ZeRO-3 gathers per layer anyway
    assert stage_chunks(layers, 0, None, GLOO) is None


def _gpt():
    import sys
    sys.path.insert(0, "examples")
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(layers=4, dim=256, heads=4, seq=32, vocab=256)
    x = torch.randint(0, 256, (8, 32))
    return GPT(cfg), (x, x)


DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


def test_planner_takes_chunks_where_they_win_and_fit() -> None:
    model, ex = _gpt()
    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    plan = autopar.plan(model, example_inputs=ex, mesh=mesh, pins=DP, zero_stage=2, pipeline_stages=1)
    d = plan.decisions
    assert len(d.gather_chunks) > 1
    parts = d.stage_parts[0]
    assert parts["gather_hidden"] > 0 and parts["gather_step"] < parts["gather_hidden"]
    # forced off: one blocking gather, the whole of it on the step
    off = autopar.plan(model, example_inputs=ex, mesh=mesh, pins=DP, zero_stage=2, pipeline_stages=1,
                       split_gathers=False)
    assert off.decisions.gather_chunks == [] and off.decisions.stage_parts[0]["gather_hidden"] == 0
    assert off.decisions.step_seconds > d.step_seconds
    # the chunk's buffers live beside fewer activations than the step's peak: no more memory
    assert "gathers" not in plan.memory and plan.memory["total"] == off.memory["total"]
    # the timeline: the chunks that arrive during the forward beside it, the waits after the step
    from autopar.report.timeline import Kind, predicted_events
    events = {e.kind: e for e in predicted_events(plan)}
    assert events[Kind.PARAM_GATHER_HIDDEN].start == 0.0
    assert events[Kind.PARAM_GATHER_HIDDEN].duration == pytest.approx(parts["gather_hidden"])
    assert events[Kind.PARAM_GATHER].duration == pytest.approx(parts["gather_step"])
    assert Kind.PARAM_GATHER_HIDDEN not in {e.kind for e in predicted_events(off)}
    # ZeRO-3 gathers per layer already: nothing to chunk
    z3 = autopar.plan(model, example_inputs=ex, mesh=mesh, pins=DP, zero_stage=3, pipeline_stages=1)
    assert z3.decisions.gather_chunks == []


def test_chunk_buffers_priced_where_they_raise_the_peak() -> None:
    """A layer of large activations before a layer of large parameters: the second
    chunk's buffers arrive beside the first layer's activations, above the step's
    other peaks.  Under a budget between the two, the stage gathers in one go."""
    from autopar.search.stages.price import price_stage
    from autopar.search.stages.priced import Config

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    layers = [LayerStat("act", forward=1e-3, seconds=3e-3, compute=3e-3, activations=1e9, out_bytes=1e3,
                        params=[ParamStat(4e6, (0,), "act.w", (1000, 1000))]),
              LayerStat("big", forward=1e-3, seconds=3e-3, compute=3e-3, activations=1e3, out_bytes=1e3,
                        params=[ParamStat(4e8, (0,), "big.w", (100000, 1000))])]

    def stage(split, budget=1e13):
        return price_stage(layers, 0, Config(zero_stage=2, zero_axis=0, recompute=(), split_gathers=split),
                           mesh, lambda b: 0.0, budget, "adamw")

    chunked, whole = stage(None), stage(False)
    assert len(chunked.gather_chunks) == 2 and whole.gather_chunks == []
    # the peak is now the second chunk's gathered and send buffers beside the first
    # layer's activations
    held = sum(whole.memory[k] for k in ("params", "optimizer", "buffers"))
    assert chunked.total_memory == pytest.approx(held + 1e9 + 4e8 * (1 + 1 / 4))
    assert chunked.total_memory > whole.total_memory
    assert chunked.parts["gather_step"] < whole.parts["gather_step"]
    lean = stage(None, budget=(chunked.total_memory + whole.total_memory) / 2)
    assert lean.gather_chunks == [] and lean.total_memory == whole.total_memory


@pytest.mark.parametrize("bad", [{"zero_stage": 3}, {"zero_stage": 0}, {"pipeline_stages": 2}])
def test_forced_chunks_that_cannot_run_are_refused(bad) -> None:
    from autopar.errors import PlanError

    model, ex = _gpt()
    with pytest.raises(PlanError, match="split_gathers=True"):
        autopar.plan(model, example_inputs=ex, mesh=MeshSpec.preset("8xA100-nvlink", shape=(4,)), pins=DP,
                     split_gathers=True, **bad)
