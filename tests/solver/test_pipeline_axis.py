"""Pipeline stages from any factor of any mesh axis (issue 10): across nodes (axis 0,
as before) or inside a node (a later axis), each carving its own stage sub-mesh with
the cluster's links and its own rank layout.  Planning only; the runtime's equivalence
is tests/dist/test_pipeline_axis.py's."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from autopar import MeshSpec, Plan, plan
from autopar.errors import PlanError
from autopar.plans.decisions import PlanOptions
from autopar.plans.roles import axis_roles
from autopar.plans.splits import pipeline_mesh, pipeline_splits, plan_ranks, split_mesh, stage_ranks
from autopar.report.timeline import chrome_trace
from autopar.search.joint import JointSearch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:the model computes")

# 2 nodes of 8 GPUs: axis 0 crosses nodes (InfiniBand), axis 1 stays inside one (NVLink)
NODES = MeshSpec.preset("multinode-a100-ib", shape=(2, 8))


def _small_nodes() -> MeshSpec:
    """2 nodes of 4 GPUs as a 2x4 mesh (links re-derived for 4 GPUs per node)."""
    m = dataclasses.replace(MeshSpec.preset("multinode-a100-ib", shape=(8,)), gpus_per_node=4)
    return m.with_shape((2, 4))


def test_every_factor_of_every_axis_is_a_split() -> None:
    assert pipeline_splits((2, 4)) == [(2, 0), (2, 1), (4, 1)]
    assert pipeline_splits((6,)) == [(2, 0), (3, 0), (6, 0)]
    assert pipeline_splits((1, 3)) == [(3, 1)]


def test_stages_inside_a_node_keep_the_node_links() -> None:
    full, sub = split_mesh(NODES, 4, axis=1)
    # four stages of 2 GPUs inside each node: the pipeline axis is NVLink, the stage
    # sub-mesh keeps the node axis (InfiniBand) and the rest of the node axis
    assert full.shape == (4, 2, 2) and sub.shape == (2, 2)
    assert full.links[0] == NODES.intra
    assert sub.links == (NODES.inter, NODES.intra)
    # across nodes (axis 0, as before): the pipeline axis is the inter-node link
    full0, sub0 = split_mesh(NODES, 2, axis=0)
    assert full0.shape == (2, 8) and sub0.shape == (8,)
    assert full0.links[0] == NODES.inter and sub0.links == (NODES.intra,)
    # the stages take the whole axis: the sub-mesh drops it
    full8, sub8 = split_mesh(NODES, 8, axis=1)
    assert full8.shape == (8, 2) and sub8.shape == (2,) and sub8.links == (NODES.inter,)
    with pytest.raises(PlanError, match="3 pipeline stages do not divide mesh axis 1 of size 8"):
        split_mesh(NODES, 3, axis=1)


def test_one_device_per_stage_on_a_node_spanning_axis() -> None:
    # before: ValueError "axis of 1 ranks is not a multiple of LinkSpec.group=8" (the
    # one-device placeholder sub-mesh took the node-spanning pipeline link), which the
    # joint search does not catch
    full, sub = split_mesh(MeshSpec.preset("multinode-a100-ib", shape=(16,)), 16)
    assert full.shape == (16,) and sub.shape == (1,) and not sub.links[0].hierarchical


def test_stage_ranks_follow_torchrun_numbering() -> None:
    # axis 0: consecutive blocks, as the runtime always laid them out
    assert torch.equal(stage_ranks((2, 4), 2, 0).flatten(), torch.arange(8))
    # axis 1 of a 2x4 mesh (2 nodes of 4): stage 0 is the first half of every node
    assert stage_ranks((2, 4), 2, 1).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert stage_ranks((2, 2), 2, 1).tolist() == [[0, 2], [1, 3]]
    assert stage_ranks((2, 4), 4, 1).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # every rank exactly once
    r = stage_ranks((2, 2, 4), 2, 2)
    assert sorted(r.flatten().tolist()) == list(range(16))


@pytest.fixture(scope="module")
def model():
    return gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=16, batch=8)


def test_stages_that_only_an_inner_axis_holds_are_planned(model) -> None:
    # before: "4 pipeline stages do not divide mesh axis 0 of size 2"
    m, ex = model
    p = plan(m, ex, NODES, pipeline_stages=4, micro_batches=4, schedule="1f1b")
    d = p.decisions
    assert (d.pipeline_stages, d.pipeline_axis) == (4, 1)
    assert tuple(p.mesh.shape) == (2, 2) and p.request.mesh_shape == [2, 8]
    assert p.world_size == 16
    pp = axis_roles(p)[0]
    assert (pp.name, pp.size, pp.link) == ("pp", 4, "intra-node")
    assert pipeline_mesh(p).links[0] == NODES.intra
    # rank 1 runs stage 0 (stages are 2-GPU blocks of every node), rank 2 stage 1
    ranks = plan_ranks(p)
    assert ranks.shape == (4, 2, 2) and int(ranks[0, 0, 1]) == 1 and int(ranks[1, 0, 0]) == 2
    # the predicted trace names each stage's ranks (before: "ranks 0-3", stage-major)
    names = [e["args"]["name"] for e in chrome_trace(p)["traceEvents"] if e.get("name") == "process_name"]
    assert names[0] == "stage 0 (ranks 0, 1, 8, 9) (predicted)"
    # the axis survives the plan's JSON (autopar.load and export read it back)
    again = Plan.from_json(p.to_json())
    assert again.decisions.pipeline_axis == 1
    assert torch.equal(plan_ranks(again), ranks)


def test_the_axis_can_be_forced(model) -> None:
    m, ex = model
    d1 = plan(m, ex, NODES, pipeline_stages=2, pipeline_axis=1, micro_batches=2).decisions
    assert (d1.pipeline_stages, d1.pipeline_axis) == (2, 1)
    d0 = plan(m, ex, NODES, pipeline_stages=2, pipeline_axis=0, micro_batches=2).decisions
    assert (d0.pipeline_stages, d0.pipeline_axis) == (2, 0)
    # the count alone: both axes hold 2 stages, and the faster carving is the plan
    # (before, only the outermost axis was tried)
    d = plan(m, ex, NODES, pipeline_stages=2, micro_batches=2).decisions
    best = min((d0, d1), key=lambda x: (x.step_seconds, x.pipeline_axis))
    assert (d.pipeline_axis, d.step_seconds) == (best.pipeline_axis, pytest.approx(best.step_seconds))
    with pytest.raises(PlanError, match="4 pipeline stages do not divide mesh axis 0 of size 2"):
        plan(m, ex, NODES, pipeline_stages=4, pipeline_axis=0)
    with pytest.raises(PlanError, match=r"pipeline_axis must be an axis of the mesh \(2, 8\)"):
        plan(m, ex, NODES, pipeline_stages=2, pipeline_axis=2)
    with pytest.raises(PlanError, match="pipeline_stages=1 asks for none"):
        plan(m, ex, NODES, pipeline_stages=1, pipeline_axis=1)


def test_the_search_prices_stages_from_every_axis(model) -> None:
    m, ex = model
    mesh = _small_nodes()
    js = JointSearch(m, ex, mesh, PlanOptions(explore=True, time_limit=60.0))
    js.run()
    tried = {(c.stages, c.axis) for c, _ in js.priced}
    # every split was at least bounded (skipped only when its compute alone is slower)
    assert {(1, 0), (2, 0), (2, 1), (4, 1)} <= tried
