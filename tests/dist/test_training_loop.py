"""Habits of an ordinary training loop, on real gloo ranks (tests/dist/loop_cases.py).

Each test says what it saw on the main before the issue "Real models, real training
loops".  Tolerances: fp32 sums in another order change results by a few ulps, so
losses and norms compare with rtol 1e-5 and gradients with atol 1e-6 (values O(0.1));
checkpoints and broadcast weights must be bit-exact (they are copies, not sums).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_fn_cases
from tests.dist.loop_cases import TP_MLP, Net

FN = "tests.dist.loop_cases:run"
TWO = [
    {"id": "clip-tp", "fn": "clip_norm", "mesh": [2], "pins": TP_MLP},
    {"id": "names", "fn": "names_modes_frozen", "mesh": [2]},
    {"id": "seeds", "fn": "seeds_and_shapes", "mesh": [2]},
    {"id": "local-dp", "fn": "local_batch", "mesh": [2], "pins": {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}},
    {"id": "local-tp", "fn": "local_batch", "mesh": [2], "pins": TP_MLP | {"input:0": "R"}},
    {"id": "local-logits", "fn": "local_outputs", "mesh": [2], "pins": {"*": "R", "input:0": "S(0)"}},
]


DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
# gradient accumulation over plain backward() calls, per parallelism kind (two ranks)
ACCUMULATE = {"dp": dict(pins=DP, zero_stage=0), "dp-local": dict(pins=DP, zero_stage=0, batch="local"),
              "tp": dict(pins=TP_MLP, zero_stage=0), "zero1": dict(pins=DP, zero_stage=1),
              "zero3": dict(pins=DP, zero_stage=3),
              "micro2": dict(pins=DP, zero_stage=0, micro_batches=2, pipeline_stages=1)}
# and on a 2x2 mesh: data parallel over both axes, tensor x data parallel
ACCUMULATE_2X2 = {"dp2x2": dict(pins={"*": "RR", "input:0": "S(0)S(0)", "input:1": "S(0)S(0)"}, zero_stage=0),
                  "dp-tp": dict(pins={k: "R" + v for k, v in TP_MLP.items()} | {"input:0": "S(0)R", "input:1": "S(0)R"},
                                zero_stage=0)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    return run_fn_cases(2, FN, TWO + [{"id": "export", "fn": "export_load", "mesh": [2],
                                       "dir": str(d / "out")},
                                      {"id": "trace", "fn": "trace", "mesh": [2], "dir": str(d)},
                                      {"id": "zero3", "fn": "zero3_collectives", "mesh": [2]},
                                      {"id": "dp-bwd", "fn": "dp_backward_collectives", "mesh": [2]},
                                      {"id": "kept-grads", "fn": "kept_gradients", "mesh": [2]},
                                      *[{"id": f"around-{k}", "fn": "grads_around_backward", "mesh": [2],
                                         "pins": pins} for k, pins in (("dp", DP), ("tp", TP_MLP))],
                                      *[{"id": f"acc-{k}", "fn": "accumulated_backwards", "mesh": [2],
                                         "kw": kw, "local": k == "dp-local"} for k, kw in ACCUMULATE.items()],
                                      *[{"id": f"local-step-{k}", "fn": "local_steps", "mesh": [2], "pins": pins}
                                        for k, pins in (("dp", DP), ("tp", TP_MLP))],
                                      *[{"id": f"local-step-zero{z}", "fn": "local_steps", "mesh": [2],
                                         "pins": DP, "zero_stage": z} for z in (1, 3)],
                                      {"id": "two-meshes", "fn": "two_meshes"},
                                      {"id": "dcp-pipeline", "fn": "dcp_pipeline",
                                       "dir": str(d / "ckpt-pipeline")},
                                      # last: it destroys the process group
                                      {"id": "shutdown", "fn": "shutdown_joins_threads", "mesh": [2],
                                       "pins": TP_MLP}])


@pytest.fixture(scope="module")
def four():
    """The default suite's 4-rank cases (accumulation and local steps on 2x2)."""
    return run_fn_cases(4, FN, [
        *[{"id": f"acc-{k}", "fn": "accumulated_backwards", "mesh": [2, 2], "kw": kw}
          for k, kw in ACCUMULATE_2X2.items()],
        {"id": "local-step-dp2x2", "fn": "local_steps", "mesh": [2, 2], "pins": ACCUMULATE_2X2["dp2x2"]["pins"]},
    ])


@pytest.fixture(scope="module")
def four_more(tmp_path_factory):
    """The slow step's 4-rank cases (checkpoint resharding, local batches on 2x2): a
    group of their own, so the default suite does not run cases it does not check."""
    d = tmp_path_factory.mktemp("ckpt")
    return run_fn_cases(4, FN, [
        {"id": "dcp", "fn": "dcp_reshard", "dir": str(d)},
        {"id": "dcp-zero1-axes", "fn": "dcp_zero_axes", "dir": str(d), "stage": 1},
        {"id": "dcp-zero3-axes", "fn": "dcp_zero_axes", "dir": str(d), "stage": 3},
        {"id": "local-2x2", "fn": "local_batch", "mesh": [2, 2],
         "pins": {k: "R" + v for k, v in TP_MLP.items()} | {"input:0": "S(0)R"}},
        {"id": "local-logits-2x2", "fn": "local_outputs", "mesh": [2, 2],
         "tp": True},
    ]), d


def _ok(r: dict) -> dict:
    assert "error" not in r, r.get("error")
    return r


def test_modules_on_two_meshes_train_in_turn(two):
    """A module runs on its own mesh whatever module ran last (runtime.mesh.activate)."""
    r = _ok(two["two-meshes"])
    # fp32 sums in another order than the single process: 1e-6 of gradients of order 1
    assert all(e < 1e-5 for e in r["grad_err"]), r
    assert len(r["grad_err"]) == 3


def test_dcp_round_trip_under_interleaved_pipeline(two):
    r = _ok(two["dcp-pipeline"])
    assert r["chunks"] == 2  # each rank really held two model chunks
    assert r["params"] and r["moments"]  # bit-exact, every parameter and AdamW moment
    for saved, loaded in r["losses"]:  # and the next step is the same on every rank
        assert saved == loaded


def test_clip_grad_norm_is_global(two):
    # before: 0.7709 on rank 0 and 0.7696 on rank 1 (each rank's local shards' norm)
    r = _ok(two["clip-tp"])
    assert r["is_dtensor"]
    for n in r["norms"]:
        assert n == pytest.approx(r["ref"], rel=1e-5)
    assert r["clipped_err"] < 1e-6


def test_names_train_eval_frozen_unused(two):
    r = _ok(two["names"])
    # before: keys carried an "inner." prefix and parameters were the graph's locals
    assert r["sd_keys"] == r["ref_keys"]
    assert r["param_names"] == r["ref_param_names"]
    # before: pm.eval() raised NotImplementedError
    assert r["eval_err"] < 1e-6 and r["eval_training"] is False
    assert r["train_varies"]
    # before: frozen parameters came back trainable and moved after a step
    assert r["frozen_grad_none"] and not r["frozen_requires_grad"] and r["frozen_moved"] == 0.0
    assert r["frozen_not_synced"]
    # before: unused parameters and buffers vanished from full_state_dict()
    assert r["unused_kept"] and r["full_keys"] and r["nonpersistent_absent"]


def test_rank0_weights_and_shape_errors(two):
    r = _ok(two["seeds"])
    # before: each rank kept the weights of its own seed
    assert len(set(r["weights"])) == 1 and r["weights"][0] == pytest.approx(r["rank0_model"], rel=1e-6)
    # a batch of 6 where 8 was planned runs the same plan (before: InputMismatchError);
    # the loss is the single process's up to the order of sums
    assert r["small_batch"] < 1e-5


def test_loaded_export_keeps_the_habits(two):
    # before: a reloaded module silently dropped the extra sample of a larger batch,
    # lost unused tensors and unfroze frozen ones
    r = _ok(two["export"])
    assert r["keys"] and r["unused"] and r["frozen"] and r["loss"] < 1e-6
    assert r["small_batch"].startswith("InputMismatchError") and "(9, 16)" in r["small_batch"]
    # a local-batch export: rows passed as they are, or the global batch cut by the module
    assert r["local_loss"] < 1e-6 and r["global_loss"] < 1e-6, r


@pytest.mark.parametrize("case,dp", [("local-dp", 2), ("local-tp", 1)])
def test_local_batch(two, case, dp):
    # before: no batch="local" mode, no data_parallel_rank/size
    r = _ok(two[case])
    assert [s for _, s in r["dp"]] == [dp] * 2
    assert sorted(k for k, _ in r["dp"]) == ([0, 1] if dp == 2 else [0, 0])
    for losses in r["losses"]:
        assert losses == pytest.approx(r["refs"], rel=1e-5)
    # fp32 sums in another order than the single process
    assert r["grad_err"] < 1e-5, r["grad_err"]
    # data parallel passes each rank's rows to the graph as they are (before: one
    # all-gather per batch input, which DDP does not issue; the TP case has one
    # data-parallel rank, nothing to gather).  The TP case's two ranks exchange
    # activations, so they compare the call's shapes: one all-gather of a few
    # integers, which plan.collectives() lists
    assert r["shape_checks"] == (1 if case == "local-tp" else 0)
    assert r["gathers"] == r["shape_checks"], r["gathers"]


def _local_outputs(r: dict, rows: int) -> None:
    assert r["logits_shape"][0] == rows  # this rank's rows only: no gather of the logits
    # fp32 in another summation order: a few ulps of O(1) logits
    assert r["logits_err"] <= 1e-5
    # the model's own loss is still the global batch's
    assert r["model_loss"] == pytest.approx(r["ref_model_loss"], rel=1e-5)
    # the mean of the ranks' own losses, as DDP averages: tolerance of hf_case.py
    assert r["grad_err"] <= 2e-5 + 1e-4 * r["grad_scale"], (r["grad_worst"], r["grad_err"])


def test_local_batch_returns_this_ranks_rows_of_the_logits(two):
    # before: every rank got all 8 rows (the logits gathered over the data-parallel axis,
    # a cost the plan paid or avoided by computing the head unsharded)
    r = _ok(two["local-logits"])
    assert r["local_axes"] == [0] and sorted(r["dp"]) == [[0, 2], [1, 2]]
    _local_outputs(r, 4)


@pytest.mark.slow  # a 4-rank process group
def test_local_batch_returns_rows_under_dp_x_tp(four_more):
    r = _ok(four_more[0]["local-logits-2x2"])
    # the data-parallel axes follow the first batch-shaped output (search.local_axes):
    # since the loss's reductions are off the step (runtime/pending.py) the planner
    # computes the head and loss with the rows split over both axes, so every rank is a
    # data-parallel rank of its own and gets its quarter of the logits (before: [0], TP
    # peers sharing a half). The input pinned S(0)R is then gathered from the 4 ranks
    # and re-sliced by the binder (8 x 16 token ids per step)
    assert r["local_axes"] == [0, 1] and sorted(r["dp"]) == [[0, 4], [1, 4], [2, 4], [3, 4]]
    _local_outputs(r, 2)


@pytest.mark.slow  # a 4-rank process group
def test_local_batch_2x2(four_more):
    r = _ok(four_more[0]["local-2x2"])
    # tensor-parallel peers (axis 1) share a data-parallel rank
    assert sorted(r["dp"]) == [[0, 2], [0, 2], [1, 2], [1, 2]]
    for losses in r["losses"]:
        assert losses == pytest.approx(r["refs"], rel=1e-5)


@pytest.mark.slow  # a 4-rank process group (TP2 x DP2 -> DP4 needs four ranks)
def test_dcp_round_trip_and_reshard(four_more):
    # before: DCP de-duplicated different shards saved under one key (silent corruption)
    res, d = four_more
    r = _ok(res["dcp"])
    assert r["same"] and r["dp4"] and r["zero3"], r
    assert r["same_optim"] and r["dp4_optim"]
    assert r["same_placements"] != r["dp4_placements"]
    # into the plain model in one process (no process group): DCP reshards to whole tensors
    import torch.distributed.checkpoint as dcp

    model = Net()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=d)
    expected = torch.load(d / "expected.pt")
    assert all(torch.equal(sd["model"][k], v) for k, v in expected.items())


@pytest.mark.slow  # a 4-rank process group (every other user of it is slow already)
@pytest.mark.parametrize("case", ["dcp-zero1-axes", "dcp-zero3-axes"])
def test_dcp_round_trip_under_zero_over_two_axes(four_more, case):
    """ZeRO over both axes of a 2x2 mesh: the model and AdamW's flat state saved with DCP
    load bit-exactly into the same plan, and the next step agrees too."""
    r = _ok(four_more[0][case])
    assert r["zero_axes"] == [0, 1]
    assert r["loaded"] and r["stepped"], r


def test_trace_records_real_steps_per_rank(two):
    """Issue 13: pm.trace writes a Chrome trace per rank with the ops, the collectives
    the tensor-parallel plan issues, and one ProfilerStep per t.step()."""
    r = two["trace"]
    assert r["files"] == [True, True] and r["aten"] == [True, True]
    assert all(r["collective"]), r["collective"]
    # (the profiler opens one more, empty, step after the last t.step())
    assert all({"ProfilerStep#0", "ProfilerStep#1"} <= set(x) for x in r["steps"]), r["steps"]


def test_zero3_gathers_one_collective_per_layer(two):
    """Issue 11: ZeRO-3 issued one all-gather per parameter in the forward, one per
    saved parameter in backward and one reduce-scatter per parameter (186 collectives
    per step for a 4-layer GPT); now one per layer (pre, 2 blocks, post): 4 gathers in
    the forward, at most 4 re-gathers in backward, 4 reduce-scatters. The loss stays
    the single-process model's through three AdamW steps (fp32 sums in another order:
    a few ulps of a loss of ~5.5)."""
    r = two["zero3"]
    assert r["gathers_in_graph"] == 4
    coll = r["collectives"]
    gathers = sum(v for k, v in coll.items() if "all_gather" in k)
    # gloo runs a reduce-scatter as an all-reduce (the profiler names it so): 4 of them,
    # plus the loss's and the token count's all-reduces of data parallelism
    reduces = sum(v for k, v in coll.items() if "all_reduce" in k or "reduce_scatter" in k)
    assert 4 <= gathers <= 8 and 4 <= reduces <= 8, coll
    assert sum(coll.values()) <= 16, coll
    assert r["loss_err"] < 1e-5


def test_data_parallel_backward_issues_only_gradient_buckets(two):
    """Issue 11: DP's backward all-reduced the loss's 4-byte gradient before any
    gradient bucket (one latency-bound collective DDP does not issue); now the backward
    issues exactly one all-reduce per gradient bucket. Gradients still equal the
    single-process model's (fp32 sums in another order: atol 1e-6, values O(0.1))."""
    r = two["dp-bwd"]
    assert r["backward"] == {"gloo:all_reduce": r["buckets"]}, r
    # the runtime reduces exactly the buckets the plan chose (autopar/search/buckets.py)
    assert r["run_buckets"] == r["planned"] and r["planned"], r
    assert r["grad_err"] < 1e-6 and r["loss_err"] < 1e-5


def test_data_parallel_loss_is_reduced_only_when_read(two):
    """Issue 11: DP's forward waited for the loss's all-reduce (a latency-bound
    collective DDP does not issue). Now it is started and left in flight: after
    forward, ``detach()`` and ``backward()`` nothing has waited (before: the loss was a
    plain tensor, reduced in the forward), and reading it anywhere gives the
    single-process loss (fp32 sums in another order: 1e-5)."""
    r = two["dp-bwd"]
    assert r["in_flight"] == ["PendingSum", "PendingSum"], r
    u = r["uses"]
    assert u["item"] < 1e-5 and u["times2"] < 2e-5 and u["saved"] < 1e-5, u
    assert u["repr"] and u["plain"], u


def test_data_parallel_token_count_starts_before_the_model(two):
    """Issue 11: the cross-entropy's token-count all-reduce started at the loss and was
    waited for a few ops later, a synchronisation point with every rank in the forward.
    Now it starts where the labels are sliced, before the first op of the model (the
    embedding), and is waited for at the loss; its value is checked by the loss above
    and, with ignored targets, by test_losses.py's ce-ignore."""
    r = two["dp-bwd"]
    assert len(r["count_at"]) == 1 and r["count_at"][0] < r["first_op"], r


def test_gradients_serve_every_step_unless_kept(two):
    """Issue 11: each backward took new gradient buffers and a new DTensor gradient per
    parameter (about 1.5 ms of CPU a step against DDP for the 4-layer GPT). Now both
    serve the next step, except the gradients the loop kept across ``zero_grad()``
    (the DTensor and a ``to_local()`` of another), which keep their values; gradients
    match the single process after a fresh step, after accumulating two backwards and
    after ``zero_grad(set_to_none=False)`` (fp32 sums of two ranks in another order:
    1e-6 on values O(0.1))."""
    r = _ok(two["kept-grads"])
    assert max(r["errs"]) < 1e-6 and len(r["errs"]) == 4, r
    assert r["intact"] and r["kept_plan"], r
    assert r["same"] == [n for n in r["names"] if n not in ("fc1.bias", "fc2.weight")], r


@pytest.mark.parametrize("kind", ["dp", "tp"])
def test_gradients_around_a_backward(two, kind):
    """torch.autograd.grad after a reducing backward (an input's gradient) left the
    parameters' gradients divided by the ranks (the accumulation rule undid nothing:
    no bucket reduced); a zero_grad() between a forward and its backward gave old +
    new gradients (the mirror of zero_grad() ran only at the next forward); the
    DTensor gradients kept for the next step included unbucketed parameters' (tensor
    parallel's sharded weights), holding their old gradients a step longer. fp32
    sums in another order: 1e-6."""
    r = _ok(two[f"around-{kind}"])
    assert r["after_grad"] < 1e-6 and r["after_zero"] < 1e-6 and r["gx"], r
    assert r["bucketed"] and set(r["cached"]) <= set(r["bucketed"]), r


@pytest.mark.parametrize("kind", [*ACCUMULATE, *ACCUMULATE_2X2])
def test_backwards_accumulate_without_zero_grad(two, four, kind):
    """Three backward() calls without zero_grad() between them: data parallel's buckets
    reduced the gradients already there with the new ones, so from the second backward
    on every rank's equal share was counted once per rank (error 0.1 on two ranks,
    with data parallel, tensor parallel's replicated bias and micro-batches; ZeRO was
    right). After zero_grad() one more. fp32 sums in another order: 1e-6 on values
    O(0.1-1)."""
    r = _ok((two if kind in ACCUMULATE else four)[f"acc-{kind}"])
    assert max(r["errs"]) < 1e-6, r


@pytest.mark.parametrize("kind", ["dp", "dp2x2", "tp", "zero1", "zero3"])
def test_optimizer_steps_parameters_locally(two, four, kind):
    """torch.optim steps over DTensors paid DTensor's dispatch per op per tensor (2.9 ms
    a step for AdamW over a 69-tensor GPT here), which DDP's plain parameters do not.
    Parameters now step on their local tensors, replicated (data parallel) or sharded
    (tensor parallel, ZeRO's flat shards; before, only replicated ones): parameters and
    every state value must come out bit-identical to the DTensor step (the same local
    arithmetic), the state still DTensors with the parameter's placements, the groups
    still the DTensor parameters. A replaced gradient and a closure step on DTensors as
    before."""
    r = _ok((four if kind == "dp2x2" else two)[f"local-step-{kind}"])
    copies = r.pop("deepcopy")
    # deep copies of the parameters are not the module's: stepped as DTensors, they move
    assert copies == {"taken": 0, "moved": True}, copies
    expect = {"replaced-grad": [1, 0, 1],  # the user's gradient, not the runtime's: on DTensors
              "closure": [0, 0, 0],  # a closure may replace a gradient after the pre-hook
              "own-hook": [0, 0, 0]}  # the user's step hooks would see the local tensors
    for name, o in r.items():
        assert o["params_equal"] and o["moved"], (name, o)
        assert o["state_keys_equal"] and o["state_equal"] and "DTensor" in o["state_types"], (name, o)
        # state_dict() packs the state in its order: a parameter's state made a step
        # late comes last, as on DTensors
        assert o["order_equal"], (name, o)
        assert o["groups_hold_params"] and o["sd_keys_equal"], (name, o)
        assert o["taken_off"] == [0, 0, 0], (name, o)
        assert o["taken_on"] == expect.get(name, [1, 1, 1]), (name, o)
    assert r["own-hook"]["seen_on"] == ["DTensor"] * 3
    # a step that raised leaves the locals until state_dict() puts them back
    assert r["raised"]["swapped"] == {"after_raise": True, "after_state_dict": False}
    if "0-dim" in r:  # (replicated cases)
        # a 0-dim parameter's moments are DTensors, as zeros_like of the DTensor makes them
        assert r["0-dim"]["state_types"] == ["DTensor", "Tensor"]


def test_shutdown_joins_gloo_threads(two):
    # before: 3 gloo threads (one tcp loop, two workers) outlived shutdown(); at exit they
    # could drop a finished work after finalization began and abort the process
    # (docs/training.md's first example under torchrun, about 1 run in 20 under load)
    r = _ok(two["shutdown"])
    assert r["before"], "a gloo process group ran the step"
    assert r["after"] == [], r["after"]
