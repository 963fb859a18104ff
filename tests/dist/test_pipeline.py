"""Pipeline parallelism and gradient accumulation on real gloo ranks, against the
single-process model on the same global batch (8 sequences).

Each case plans the way the planner will: capture at the micro-batch size, search the
placements on the stage's sub-mesh, set ``plan.decisions`` (stages, schedule, micro
batches), lower, load this rank's shards, split the stages
(:func:`autopar.passes.split_stages.split_stages`) and train with
:class:`autopar.runtime.pipeline.PipelineRunner`.  Every rank compares the gradients
and parameters it holds (its stage's, sharded per the plan) with the same shard of the
reference; rank 0 reports the worst error over all ranks.

Tolerances (fp32).  The pipelined step computes the same sums in a different order:
four micro-batch gradients are accumulated instead of one matmul over the batch, the
loss mean is a mean of four means, and tensor/data parallel cases add sharded
contractions and all-reduce trees.  Each reordering changes results by a few ulps of
the largest intermediate, as in tests/dist/test_equivalence.py, so we use its bounds:
loss rtol 1e-5; gradients atol 2e-5 + 1e-4 x the largest reference gradient (values
O(1e-2..1)); parameters after two AdamW steps (lr 1e-3, each update bounded by lr)
2e-5, i.e. 2% of one step, which absorbs the reordering's effect on m/sqrt(v) where v
is tiny.  A wrong micro-batch weighting (e.g. 1 instead of 1/M) or a missed or doubled
gradient all-reduce is off by 25-300%, far outside these bounds.
"""

from __future__ import annotations

import copy
import importlib
import time
from dataclasses import asdict, dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.harness import _max_err, run_fn_cases
from tests.dist.test_equivalence import MEGATRON

FN = "tests.dist.test_pipeline:run_pipeline_case"
GPT2 = [["pre", "blocks.0"], ["blocks.1", "post"]]
DP = {"*": "R", "input:0": "S(0)"}


@dataclass
class PipeCase:
    """One scenario: model factory (``"module:function"``, module in examples/ or
    importable), sub-mesh, pins, pipeline stages (empty: no pipeline), schedule."""

    id: str
    factory: str
    sub_mesh: tuple[int, ...]
    stages: list[list[str]]
    schedule: str
    micro_batches: int = 4
    pins: dict = field(default_factory=dict)
    build_kwargs: dict = field(default_factory=dict)


# ------------------------------------------------------------ a model with a skip
class SkipNet(nn.Module):
    """A linear embedding, three blocks and a head that also reads the embedding: in
    a 4-stage pipeline the embedding output skips stages 1 and 2 (forwarded)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(x)
        h = h0
        for b in self.blocks:
            h = torch.tanh(b(h))
        return F.mse_loss(self.head(h + h0), y)


class TiedNet(nn.Module):
    """Token embedding tied to the output head (as GPT-2): a pipeline that puts them in
    different stages must be refused."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def build_skipnet(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """SkipNet and one batch."""
    torch.manual_seed(0)
    return SkipNet(), (torch.randn(batch, 8), torch.randn(batch, 8))


SKIP4 = [["pre"], ["blocks.0"], ["blocks.1", "blocks.2"], ["post"]]


# ------------------------------------------------------------ planning (no ranks)
def _factory(path: str):
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def plan_and_lower(model: nn.Module, batch: tuple, case: PipeCase, broadcast: bool = False):
    """Capture ``model`` at the micro-batch size, plan on the sub-mesh, set the pipeline
    decisions and lower a copy; returns (captured, plan, lowered graph)."""
    import torch.distributed as dist
    from autopar.cost_models import MeshSpec
    from autopar.passes.lower import lower

    from autopar.capture.annotate import annotate
    from autopar.capture.trace import capture
    from autopar.plans.data import Plan
    from autopar.plans.decisions import Decisions, PlanOptions
    from autopar.search.op_placement import make_plan

    m = case.micro_batches
    micro = tuple(x[: x.shape[0] // m] for x in batch)
    cap = capture(model, micro)
    annotate(cap.gm)
    sub = MeshSpec.preset("cpu-gloo", shape=tuple(case.sub_mesh))
    if broadcast:
        # rank 0 plans and broadcasts, as ParallelModule does: one plan for all ranks
        # (a time-limited solver may differ between ranks) and less CPU on 2 cores
        box = [make_plan(cap.gm, sub, cap.aliases, PlanOptions(pins=dict(case.pins))).to_json()
               if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
    else:
        plan = make_plan(cap.gm, sub, cap.aliases, PlanOptions(pins=dict(case.pins)))
    plan.decisions = Decisions(
        pipeline_stages=max(1, len(case.stages)), micro_batches=m,
        schedule=case.schedule if case.stages else "none", stages=case.stages,
        # every stage sends replicated values as slices (runtime/stage_wire.py), which
        # the search chooses only where the link between stages is the slow one
        sliced_sends=list(range(len(case.stages))),
        global_batch=batch[0].shape[0])
    return cap, plan, lower(copy.deepcopy(cap.gm), plan)


# ------------------------------------------------------------ one case on one rank
def run_pipeline_case(c: dict) -> dict:
    """Plan, shard, split and train case ``c`` on this rank; compare with the
    reference; rank 0 returns the worst errors over all ranks."""
    from autopar.passes.split_stages import split_stages

    from autopar.module.runners import boundary_slices
    from autopar.plans.placement import is_replicate, parse_placements
    from autopar.runtime.grad_sync import GradSync
    from autopar.runtime.mesh import init_mesh, reset
    from autopar.runtime.pipeline import PipelineRunner
    from autopar.runtime.shards import shard_tensor

    case = PipeCase(**{**c, "sub_mesh": tuple(c["sub_mesh"])})
    t0 = time.perf_counter()
    model, batch = _factory(case.factory)(**case.build_kwargs)
    ref = copy.deepcopy(model)
    cap, plan, gm = plan_and_lower(model, batch, case, broadcast=True)
    t1 = time.perf_counter()
    reset()
    rt = init_mesh(case.sub_mesh, stages=max(1, len(case.stages)))
    placements = {t: parse_placements(p) for t, p in plan.params().items()}

    def shard(full: torch.Tensor, target: str) -> torch.Tensor:
        return shard_tensor(full.detach(), placements[target], plan.mesh.shape, rt.coord)

    # load this rank's shards as fresh Parameters, then split (stages hold references)
    full_state = model.state_dict()
    for t in cap.aliases:
        *path, leaf = t.split(".")
        owner = gm.get_submodule(".".join(path))
        owner.register_parameter(leaf, nn.Parameter(shard(full_state[cap.aliases[t][0]], t)))
    stage = split_stages(gm, plan)[rt.stage]
    params = {t: gm.get_parameter(t) for t in stage.params}
    sync = GradSync([(t, p, tuple(a for a, x in enumerate(placements[t])
                                  if is_replicate(x) and plan.mesh.shape[a] > 1))
                     for t, p in params.items()], plan.decisions.grad_buckets)
    # replicated boundary values cross as slices, as the module's runner sends them
    runner = PipelineRunner(stage, case.schedule if case.stages else "none",
                            case.micro_batches, grad_sync=sync,
                            slices=boundary_slices(gm, plan, [stage]))
    refp = dict(ref.named_parameters())
    name = {t: cap.aliases[t][0] for t in params}

    # 1. loss and every gradient this rank holds
    t2 = time.perf_counter()
    loss = runner.step(batch)
    rl = ref(*batch)
    rl.backward()
    others = [t for t in cap.aliases if t not in params and gm.get_parameter(t).grad is not None]
    grads = {t: p.grad for t, p in params.items() if p.grad is not None}
    missing = [t for t in params if t not in grads]
    grad_err, grad_worst = _max_err(grads, {t: shard(refp[name[t]].grad, t) for t in grads}, grads)
    # 2. two AdamW steps
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        step_loss = runner.step(batch)
        rloss = ref(*batch)
        rloss.backward()
        losses.append((step_loss.item(), rloss.item()))
        opt.step()
        ropt.step()
    t3 = time.perf_counter()
    adam_err, adam_worst = _max_err(dict(params), {t: shard(refp[name[t]], t) for t in params},
                                    params)
    mine = {"loss": loss.item(), "ref_loss": rl.item(), "losses": losses,
            "grad_err": grad_err, "grad_worst": grad_worst, "adam_err": adam_err,
            "adam_worst": adam_worst, "names": sorted(name.values()), "missing": missing,
            "other_stage_grads": others, "stage": rt.stage, "send": stage.send,
            "recv": stage.recv, "sliced": sorted(runner.slices.axes),
            "grad_scale": max(p.grad.abs().max().item() for p in ref.parameters())}
    out = _over_ranks(mine, sorted(refp))
    out["plan_params"] = plan.params()
    out["seconds"] = {"plan_and_lower": t1 - t0, "shard_and_split": t2 - t1,
                      "three_steps_with_reference": t3 - t2}
    return out


def _over_ranks(mine: dict, all_names: list[str]) -> dict:
    """Rank 0's results with the worst errors, names and links of every rank."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = dict(every[0])
    for k in ("grad_err", "adam_err"):
        worst = max(every, key=lambda r, k=k: r[k])
        out[k], out[k.replace("err", "worst")] = worst[k], worst[k.replace("err", "worst")]
    out["names"] = sorted({n for r in every for n in r["names"]})
    out["all_names"] = all_names
    out["missing"] = [m for r in every for m in r["missing"]]
    out["other_stage_grads"] = [m for r in every for m in r["other_stage_grads"]]
    out["all_losses"] = [r["loss"] for r in every]
    out["links"] = [(r["stage"], r["recv"], r["send"]) for r in every]
    return out


# ------------------------------------------------------------ cases
TP = {k: v for k, v in MEGATRON["gpt"].items()}
TWO = [
    PipeCase("pp2-gpipe", "gpt:build", (1,), GPT2, "gpipe", build_kwargs={"layers": 2}),
    PipeCase("pp2-1f1b", "gpt:build", (1,), GPT2, "1f1b", build_kwargs={"layers": 2}),
    PipeCase("accum4-dp2", "gpt:build", (2,), [], "none", pins=DP, build_kwargs={"layers": 2}),
]
FOUR = [
    PipeCase("pp2xdp2-1f1b", "gpt:build", (2,), GPT2, "1f1b", pins=DP, build_kwargs={"layers": 2}),
    PipeCase("tp2xpp2-gpipe", "gpt:build", (2,), GPT2, "gpipe", pins=TP,
             build_kwargs={"layers": 2}),
    PipeCase("pp4-skip-1f1b", "tests.dist.test_pipeline:build_skipnet", (1,), SKIP4, "1f1b"),
]


@pytest.fixture(scope="module")
def two_rank_results():
    return run_fn_cases(2, FN, [asdict(c) for c in TWO])


@pytest.fixture(scope="module")
def four_rank_results():
    return run_fn_cases(4, FN, [asdict(c) for c in FOUR])


def check(res: dict) -> None:
    assert "error" not in res, res.get("error")
    assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-5)
    # the step's loss reaches every rank, not just the last stage
    assert res["all_losses"] == pytest.approx([res["ref_loss"]] * len(res["all_losses"]), rel=1e-5)
    for got, want in res["losses"]:
        assert got == pytest.approx(want, rel=1e-5)
    # every parameter is trained by exactly one stage, and no other stage touches it
    assert res["names"] == res["all_names"]
    assert not res["missing"], f"no gradient for {res['missing']}"
    assert not res["other_stage_grads"], res["other_stage_grads"]
    tol = 2e-5 + 1e-4 * res["grad_scale"]
    assert res["grad_err"] <= tol, f"gradient of {res['grad_worst']} off by {res['grad_err']}"
    assert res["adam_err"] <= 2e-5, f"{res['adam_worst']} after AdamW off by {res['adam_err']}"


def _get(results: dict, case: PipeCase) -> dict:
    return results.get(case.id, {"error": "not run (an earlier case failed)"})


@pytest.mark.parametrize("case", TWO, ids=[c.id for c in TWO])
def test_two_ranks(two_rank_results, case):
    check(_get(two_rank_results, case))


@pytest.mark.parametrize("case", FOUR, ids=[c.id for c in FOUR])
def test_four_ranks(four_rank_results, case):
    res = _get(four_rank_results, case)
    check(res)
    params = res["plan_params"].values()
    if case.pins is TP:  # the forced tensor parallelism really happened
        assert any("S(" in p for p in params), res["plan_params"]
        # the residual stream, replicated over the stages' 2 tensor-parallel ranks,
        # crossed the boundary as one slice from each, all-gathered where it arrived
        assert res["sliced"] == ["add_2"], res["sliced"]
    elif case.pins is DP:
        assert all(p == "R" for p in params), res["plan_params"]
    if case.id.startswith("pp4-skip"):
        # the embedding output (addmm) is forwarded through stages 1 and 2
        links = {s: (recv, send) for s, recv, send in res["links"]}
        assert len(links[1][1]) == 2 and len(links[2][0]) == 2 and len(links[3][0]) == 2


# ------------------------------------------------------------ splitting (no ranks)
def _split(factory, case: PipeCase):
    from autopar.passes.split_stages import split_stages

    model, batch = factory()
    _, plan, gm = plan_and_lower(model, batch, case)
    return model, batch, gm, split_stages(gm, plan)


def test_split_chain_equals_whole_graph():
    """Chaining the stage modules by hand gives the whole graph's loss and gradients,
    and the stages hold the graph's own Parameter objects."""
    import sys

    from tests.dist.harness import ROOT
    sys.path.insert(0, str(ROOT / "examples"))
    case = PipeCase("split", "", (1,), SKIP4, "gpipe", micro_batches=1)
    _, batch, gm, stages = _split(build_skipnet, case)
    assert [s.inputs for s in stages] == [[0], [], [], [1]]
    assert stages[0].send == stages[1].recv and stages[2].send == stages[3].recv
    whole = gm(*batch)
    whole = whole[0] if isinstance(whole, tuple) else whole
    whole.backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)
    vals: list = []
    for s in stages:
        assert all(s.module.get_parameter(t) is gm.get_parameter(t) for t in s.params)
        outs = s.module(*[batch[i] for i in s.inputs], *vals)
        vals = list(outs[: len(s.send)])
    outs[-1].backward()
    assert outs[-1].item() == pytest.approx(whole.item(), rel=1e-6)
    for n, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)


def test_split_refuses_tied_weights():
    from autopar.errors import PlanError

    def build():
        torch.manual_seed(0)
        tokens = torch.randint(0, 32, (8, 4))
        return TiedNet(), (tokens, tokens.roll(-1, 1))
    case = PipeCase("tied", "", (1,), [["pre", "blocks.0"], ["blocks.1", "post"]], "gpipe")
    with pytest.raises(PlanError, match="tok.weight|head.weight"):
        _split(build, case)


def test_split_refuses_non_monotone_stages():
    from autopar.errors import PlanError

    case = PipeCase("order", "", (1,), [["pre", "blocks.1"], ["blocks.0", "blocks.2", "post"]],
                    "gpipe")
    with pytest.raises(PlanError, match="not monotone"):
        _split(build_skipnet, case)


def test_split_after_recompute():
    """Checkpointed layers (passes/recompute.py: a get_attr of a submodule plus a
    checkpoint call, tagged with the layer) split like plain ones, exactly."""
    import sys

    from tests.dist.harness import ROOT
    recompute = pytest.importorskip("autopar.passes.recompute").recompute
    sys.path.insert(0, str(ROOT / "examples"))
    build = _factory("gpt:build")
    case = PipeCase("rc", "", (1,), GPT2, "gpipe", micro_batches=1)
    model, batch = build(layers=2, batch=2)
    _, plan, gm = plan_and_lower(model, batch, case)
    whole = gm(*batch)[0]
    whole.backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)
    from autopar.passes.split_stages import split_stages
    stages = split_stages(recompute(gm, {"blocks.0", "blocks.1"}), plan)
    vals: list = []
    for s in stages:
        outs = s.module(*[batch[i] for i in s.inputs], *vals)
        vals = list(outs[: len(s.send)])
    outs[-1].backward()
    assert outs[-1].item() == whole.item()
    for n, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)
