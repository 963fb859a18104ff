"""One plan serves every shape a training or evaluation loop feeds (issue 65), on 2 and
4 gloo ranks against the single process (tests/dist/shape_cases.py runs the loop).

A tiny Hugging Face Llama is planned at 4 x 16 tokens; the loop then feeds shorter and
longer sequences, a global batch of 3 on 2 data-parallel ranks, fine-tuning batches
padded to their own longest sequence, and evaluates at batch 1 (a pipeline: at a padded
batch of 4, its loss).  On b9d1a2b every one
of these raised ``InputMismatchError`` at the first other shape, and under
``batch="local"`` a rank whose rows matched the planned shape waited in a collective
while its peer raised.

Tolerances, as test_hf_models.py: losses rel 1e-5 (sums in another order across ranks);
weights after the AdamW steps (lr 1e-3) 3e-5 (a gradient near zero divided by AdamW's
sqrt(v) ~ |g| moves an update by a few percent of lr); evaluation logits (O(1)) 1e-5.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_fn_cases

FN = "tests.dist.shape_cases:run"
TRAIN = [[16] * 4, [10, 7, 10, 3], [16, 16, 12], [20, 5]]  # planned; padded; 3 rows; 2 rows
# batch="local": each data-parallel rank's rows of every global batch (uneven), each
# trimmed to its own longest sequence (a collator per rank)
LOCAL = {"batch": "local", "trim": True, "steps": [[16] * 4, [10, 7, 10, 3], [16, 16, 12], [20, 5, 9, 9, 9]]}
LENGTHS = [[16] * 4, [10, 7, 10, 3], [12, 5, 12, 12], [9, 9, 2, 4], [20, 3, 3, 3], [7] * 4, [10, 2, 2, 2]]
TWO = [
    {"id": "dp", "plan": "dp", "mesh": [2], "steps": TRAIN},
    {"id": "tp", "plan": "tp", "mesh": [2], "steps": TRAIN},
    {"id": "zero3", "plan": "zero3", "mesh": [2], "steps": TRAIN},
    # six lengths at 4 rows: the first two exported, the four after given by the symbolic
    # export the second one made (autopar/capture/any_shape.py)
    {"id": "tp-lengths", "plan": "tp", "mesh": [2], "steps": LENGTHS},
    {"id": "zero3-lengths", "plan": "zero3", "mesh": [2], "steps": LENGTHS},
    {"id": "local", "plan": "ddp", "mesh": [2], "split": [[2, 2], [2, 2], [2, 1], [1, 4]], **LOCAL},
    # context parallel over 2, a length of 17 and of 9 (no split that divides)
    {"id": "cp", "plan": "cp", "mesh": [2], "steps": [[16] * 4, [17] * 4, [9] * 2]},
    # 2 stages, 2 micro-batches of 2 rows planned: a new length; 3 rows (one micro-batch
    # of 3: at one row a micro-batch's graph is not the planned one); 6 rows (3 of 2)
    {"id": "pp", "plan": "pp", "mesh": [2], "steps": [[16] * 4, [12] * 4, [16] * 3, [20] * 6]},
    # padded batches: the micro-batches hold different numbers of real tokens, weighted
    # by them (token_weights.py), as the whole batch's token mean
    {"id": "pp-padded", "plan": "pp", "mesh": [2], "steps": [[16] * 4, [10, 7, 10, 3], [16, 3, 9, 16, 5, 2]]},
    {"id": "accumulate", "plan": "accumulate", "mesh": [2], "steps": [[16] * 4, [10, 7, 10, 3], [16, 12, 9, 4]]},
    # two interleaved copies of each half batch (multi-copy): at the planned shape, padded
    {"id": "copies", "plan": "copies", "mesh": [2], "steps": [[16] * 4, [16, 5, 9, 12], [16, 2, 16, 7]]},
    {"id": "copies-items", "plan": "copies", "mesh": [2], "items": True,
     "steps": [[16] * 4, [16, 5, 9, 12], [16, 2, 16, 7]]},
    # the loss a sum over the batch's count of tokens passed in (num_items_in_batch)
    {"id": "pp-items", "plan": "pp", "mesh": [2], "items": True,
     "steps": [[16] * 4, [10, 7, 10, 3], [16, 3, 9, 16, 5, 2]]},
    # under batch="local" every rank of a 2-stage pipeline feeds the same batch: ranks
    # passing different rows are refused on both
    {"id": "pp-local", "plan": "pp", "mesh": [2], "batch": "local", "steps": [[16] * 4, [16] * 4],
     "rank_rows": [[4, 4], [4, 3]]},
]
# batch="local", each data-parallel rank's rows of every global batch packed into one
# row (shape_cases.pack: no padding, position_ids restarting; uneven row counts)
PACKED = [[16] * 4, [10, 7, 10, 3], [16, 16, 12, 4, 4], [20, 5, 9, 9, 9], [30, 2, 6, 11], [7] * 4]
# rank 0 passes no rows (a sampler that splits unevenly): refused with the reason
TWO.append({"id": "local-empty", "plan": "ddp", "mesh": [2], "batch": "local", "split": [[0, 2]],
            "steps": [[12, 9]]})
TWO += [{"id": f"{p}-packed", "plan": p, "mesh": [2], "batch": "local", "pack": True, "steps": PACKED}
        for p in ("ddp", "zero3")]
# pack=True: every batch passed padded, as in TRAIN; autopar packs the real tokens into
# one row per rank (batch="local") or the whole batch into one row per device
FOUR_LOCAL = [[16] * 4, [10, 7, 10, 3, 8], [16, 16, 12, 5], [20, 5, 9, 9, 9, 3]]
FOUR_SPLIT = [[1, 1, 1, 1], [1, 1, 2, 1], [1, 1, 1, 1], [2, 1, 1, 2]]
AUTOPACK = [{"id": f"{p}-autopack", "plan": p, "mesh": [2], "autopack": True, "steps": TRAIN}
            for p in ("dp", "zero3", "tp", "cp", "pp")]
AUTOPACK.append({"id": "local-autopack", "plan": "ddp", "mesh": [2], "autopack": True,
                 "split": [[2, 2], [2, 2], [2, 1], [1, 4]], **LOCAL})
# a batch input gathered (pinned replicated): the ranks' shapes must agree every call, so
# their packs are padded to the widest
AUTOPACK.append({"id": "gathered-autopack", "plan": "gathered", "mesh": [2], "autopack": True,
                 "split": [[2, 2], [2, 2], [2, 1], [1, 4]], **LOCAL})
TWO += AUTOPACK
# rank 1 pads its second batch on the left, which packing refuses: both ranks raise
TWO.append({"id": "gathered-autopack-left", "plan": "gathered", "mesh": [2], "autopack": True,
            "split": [[2, 2], [2, 2]], "left": 1, **LOCAL, "steps": LOCAL["steps"][:2]})
FOUR = [
    {"id": "dp-tp", "plan": "tp", "mesh": [2, 2], "steps": TRAIN},
    {"id": "zero3", "plan": "zero3", "mesh": [4], "steps": [[16] * 4, [9, 9, 4], [30, 12, 12, 12, 12]]},
    {"id": "local", "plan": "ddp", "mesh": [4], **LOCAL, "steps": FOUR_LOCAL, "split": FOUR_SPLIT},
    {"id": "dp-cp", "plan": "cp", "mesh": [2, 2], "steps": [[16] * 4, [17] * 4, [11] * 2]},
    # 2 stages of 2 data-parallel ranks: 3 rows run as 3 micro-batches of one row, which
    # the stage's 2 ranks then both compute whole (the data-parallel axis dropped)
    {"id": "pp-dp", "plan": "pp", "mesh": [4], "steps": [[16] * 4, [12] * 4, [16] * 3, [16] * 6]},
    {"id": "ddp-packed", "plan": "ddp", "mesh": [4], "batch": "local", "pack": True, "steps": PACKED},
    {"id": "zero3-packed", "plan": "zero3", "mesh": [4], "batch": "local", "pack": True, "steps": PACKED},
    {"id": "zero3-local-autopack", "plan": "zero3", "mesh": [4], "autopack": True, **LOCAL,
     "steps": FOUR_LOCAL, "split": FOUR_SPLIT},
    {"id": "dp-tp-autopack", "plan": "tp", "mesh": [2, 2], "autopack": True, "steps": TRAIN},
]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check(res: dict, world: int, new_shapes: bool = True) -> None:
    ranks = res["ranks"]
    assert len(ranks) == world
    for r in ranks:
        assert r["ok"], r.get("error")
        assert max(_rel(a, b) for a, b in zip(r["loss"], r["ref"])) < 1e-5, (r["loss"], r["ref"])
        assert r["weights"] < 3e-5
        assert r.get("eval", 0.0) < 1e-5
    # the same loss on every rank, and new shapes were served by lowerings of this plan
    assert all(r["loss"] == ranks[0]["loss"] for r in ranks)
    assert max(r["built"] for r in ranks) >= (1 if new_shapes else 0)
    # the other shapes run as a few graphs, not one each: the plan's own layout, the
    # one with an axis dropped (a batch that does not divide), the batch of 1 planned
    # again (shape_template.py; ZeRO-3's gathers once named every shape's graph apart)
    assert max(r["families"] for r in ranks) <= 3, [r["families"] for r in ranks]


@pytest.fixture(scope="module")
def two():
    return run_fn_cases(2, FN, TWO)


@pytest.fixture(scope="module")
def four():
    return run_fn_cases(4, FN, FOUR)


@pytest.mark.parametrize("case", ["dp", "tp", "zero3", "local", "cp"])
def test_any_shape_two_ranks(two, case):
    _check(two[case], 2)


@pytest.mark.parametrize("case", ["tp-lengths", "zero3-lengths"])
def test_new_lengths_are_not_exported_again(two, case):
    """Seven batches of 4 rows, five new lengths besides the planned 16 (10 twice): the
    first two new lengths are exported (the second also with the length symbolic), the
    other three are that symbolic graph given their numbers, each step still the single
    process's loss (_check); the evaluation at batch 1 after them, another kind of shape,
    is exported.  Before, every new length was exported."""
    _check(two[case], 2)
    for r in two[case]["ranks"]:
        assert (r["built"], r["exported"], r["given"]) == (6, 3, 3), r


@pytest.mark.parametrize("case", ["ddp-packed", "zero3-packed"])
def test_packed_rows_any_length(two, case):
    """Padding-free fine-tuning: each rank's rows packed into one row of its own length
    every step (DataCollatorWithFlattening's layout; ranks of 1 and 2 rows) train as the
    single process does on the padded global batch, the same sequences (_check's
    tolerances; the evaluation compares one packed row's logits with the padded batch's
    at its real tokens).  The lengths after the second are given by the symbolic
    export, not exported."""
    res = two[case]
    _check(res, 2)
    ranks = res["ranks"]
    # the data-parallel ranks packed different rows: lengths of their own
    assert any(a != b for a, b in zip(ranks[0]["lengths"], ranks[1]["lengths"])), ranks
    for r in ranks:
        assert r["given"] >= 2 and r["exported"] <= 3, r


@pytest.mark.parametrize("case", [c["id"] for c in AUTOPACK])
def test_autopar_packs_padded_batches(two, case):
    """``pack=True``: the loop feeds every batch padded (to 16, to its own longest, 3 rows
    on 2 ranks; under ``batch="local"`` uneven rows a rank) and autopar runs only the
    real tokens, packed.  Losses, weights and a padded evaluation's logits at its real
    tokens as the single process's (_check's tolerances); the logits at padding are
    exactly 0, which only a packed run returns (the padded one computes them).  On
    638b146 ``pack=`` was an unknown option (TypeError)."""
    _check(two[case], 2)
    if case != "pp-autopack":  # a schedule's evaluation gives the loss (its logits stay on the last stage)
        assert all(r["padding"] == 0.0 for r in two[case]["ranks"])


def test_a_packing_export_loads_packing(tmp_path):
    """``pm.export`` of a ``pack=True`` module and ``autopar.load``: the plan carries the
    decision, so the loaded module packs the padded batch as the live one does (the same
    graph: equal loss and logits; zeros at padding)."""
    res = run_fn_cases(2, FN, [{"id": "export", "plan": "zero3", "mesh": [2], "autopack": True,
                                "dir": str(tmp_path / "export")}])
    for r in res["export"]["ranks"]:
        assert r["ok"], r.get("error")
        assert (r["loss"], r["logits"], r["padding"], r["pack_rows"]) == (0.0, 0.0, 0.0, 2), r


def test_a_rank_that_cannot_pack_is_refused_on_every_rank(two):
    """Under a plan whose ranks must call with equal shapes (an input gathered), a rank
    whose batch cannot be packed (left padding) raises its reason, and its peer, which
    waits for its width, raises naming it instead of hanging in the step."""
    r0, r1 = two["gathered-autopack-left"]["ranks"]
    assert not r0["ok"] and not r1["ok"]
    assert "right-padded" in r1["error"], r1["error"]
    assert "rank(s) [1] could not pack" in r0["error"], r0["error"]


def test_a_rank_with_no_rows_is_told_why(two):
    """A rank passing no rows under batch="local" raises InputMismatchError saying so
    (before, capture failed on it with "cannot reshape tensor of 0 elements"), and on the
    first call the other rank raises with that reason too rather than wait."""
    errs = [r.get("error", "") for r in two["local-empty"]["ranks"]]
    assert errs[0].startswith("InputMismatchError") and "no rows" in errs[0], errs
    assert "no rows" in errs[1], errs


def test_pipeline_any_shape(two):
    """A pipelined plan runs other lengths, and batches that do not divide into its 2
    micro-batches as equal micro-batches that do, no larger than planned where they can
    be (3 rows: one of 3; 6 rows: 3 of 2), exact against the single process."""
    _check(two["pp"], 2)
    # and the evaluation's batch of 4 x 9 as 2 micro-batches of 2
    assert sorted(two["pp"]["ranks"][0]["micro"]) == [1, 2, 2, 3], two["pp"]["ranks"][0]["micro"]


@pytest.mark.parametrize("case", ["pp", "pp-padded", "pp-items", "accumulate"])
def test_a_schedule_evaluates_under_eval(two, case):
    """``pm.eval()`` and ``pm(**batch)`` under ``torch.no_grad()`` on a pipelined or
    micro-batched plan run the schedule's forwards alone and return the batch's loss
    (a padded batch of 4, its micro-batches weighted by their tokens), rel 1e-5 of the
    single process's (the check in ``_check``); the forward raised RuntimeError asking
    for ``train_step`` before."""
    for r in two[case]["ranks"]:
        assert r["ok"], r.get("error")
        assert "eval" in r and r["eval_logits"], r  # the loss alone: logits stay on the last stage


@pytest.mark.parametrize("case", ["pp-padded", "accumulate", "pp-items", "copies", "copies-items"])
def test_micro_batches_weighted_by_their_tokens(two, case):
    """Padded batches through a pipeline's micro-batches and through gradient
    accumulation (2 micro-batches on 2 data-parallel ranks): the loss and the gradients
    are the whole batch's token mean, as one process computes them, though the
    micro-batches hold different numbers of real tokens (weighted by 1/M, as before,
    the second step's loss was 1e-3 off and the weights 3e-3).  With the count passed
    in (``num_items_in_batch``: a sum over the batch's tokens) each micro-batch weighs 1
    (1/M halved the loss and the gradients).  Multi-copy's two copies alike (their mean
    was as far off; at its planned shape, the only one it serves)."""
    _check(two[case], 2, new_shapes=not case.startswith("copies"))


def test_pipeline_local_ranks_disagreeing_refused_on_every_rank(two):
    """Under batch="local" the ranks of a pipeline must pass the same batch: one rank's
    rows differing raises on every rank (none waits in a transfer its peer refused)."""
    errs = [r.get("error", "") for r in two["pp-local"]["ranks"]]
    assert all(e.startswith("InputMismatchError") for e in errs), errs
    assert any("different shapes" in e for e in errs), errs


# ranks that agree on the first batch and pass different shapes later (rank 1 one row
# short), under batch="global" (every rank must pass the whole batch) and under
# batch="local" on a tensor-parallel plan (the two ranks share data-parallel index 0)
DIVERGE = [{"id": f"tp-{mode}", "plan": "tp", "mesh": [2], "batch": mode, "steps": [[16] * 4, [12] * 4],
            "rank_rows": [[4, 4], [4, 3]]} for mode in ("global", "local")]


@pytest.fixture(scope="module")
def diverge():
    return run_fn_cases(2, FN, DIVERGE)


@pytest.mark.parametrize("mode", ["global", "local"])
def test_tensor_parallel_ranks_diverging_refused_on_every_rank(diverge, mode):
    """A tensor-parallel plan's ranks exchange activations, so ranks calling it with
    different shapes would meet in all-reduces of different sizes: both ranks raise
    InputMismatchError naming the shapes instead (before, gloo aborted both processes:
    ``op.preamble.length <= op.nbytes``; the first-call check passes, the first batches
    being equal)."""
    errs = [r.get("error", "") for r in diverge[f"tp-{mode}"]["ranks"]]
    assert all(e.startswith("InputMismatchError") and "different shapes" in e for e in errs), errs
    assert all(f"batch='{mode}'" in e for e in errs), errs


@pytest.mark.slow
@pytest.mark.parametrize("case", [c["id"] for c in FOUR])
def test_any_shape_four_ranks(four, case):
    _check(four[case], 4)
    if "autopack" in case:  # packed by autopar (test_autopar_packs_padded_batches)
        assert all(r["padding"] == 0.0 for r in four[case]["ranks"])


@pytest.fixture(scope="module")
def compiled():
    return run_fn_cases(2, FN, [{"id": "compile", "plan": "dp", "mesh": [2], "compile": True, "n": 20},
                                {"id": "compile-autopack", "plan": "dp", "mesh": [2], "compile": True,
                                 "autopack": True, "n": 20},
                                {"id": "compile-pp", "plan": "pp-1f1b", "mesh": [2], "compile": True, "n": 6}])


@pytest.mark.slow
def test_compile_twenty_lengths(compiled):
    """compile=True over 20 batches of random lengths: every step's loss is the single
    process's (rel 1e-5, test_compiled.py's tolerance: inductor reorders a few sums), and
    the other shapes share compiled templates: dynamo makes graphs for the planned
    shape, the first other shape (numbers fixed) and the second (numbers symbolic), then
    none for the 17 lengths after (measured: 10, 18, 19, then 19 graphs: the graph's pieces
    between its collectives, each compiled once per stage)."""
    ranks = compiled["compile"]["ranks"]
    for r in ranks:
        assert r["ok"], r.get("error")
        assert max(_rel(a, b) for a, b in zip(r["loss"], r["ref"])) < 1e-5, (r["loss"], r["ref"])
        assert len(set(r["lengths"])) == 20 and r["built"] == 20  # 20 new shapes
        assert (r["exported"], r["given"]) == (2, 18)  # two exports, then the symbolic graph
        assert r["templates"] == 2, r["templates"]  # the first shape, then widened by the second
        assert r["graphs"][-1] == r["graphs"][2] and r["graphs"][2] > r["graphs"][0], r["graphs"]


@pytest.mark.slow
def test_compile_packed_lengths(compiled):
    """compile=True with pack=True over the same 20 padded batches: exact (rel 1e-5, as
    above), 19 packed widths served by two templates; dynamo compiles the first other
    width, the second (symbolic), and once more at most: the planned graph itself, the
    first time a batch packs to the planned width (measured: 10, 18, 21 graphs, then 24 at
    the 18th batch, whose 2 rows of 32 are the planned packed shape)."""
    for r in compiled["compile-autopack"]["ranks"]:
        assert r["ok"], r.get("error")
        assert max(_rel(a, b) for a, b in zip(r["loss"], r["ref"])) < 1e-5, (r["loss"], r["ref"])
        assert r["templates"] == 2 and (r["exported"], r["given"]) == (2, 17), r
        assert len(set(r["graphs"][2:])) <= 2, r["graphs"]


@pytest.mark.slow
def test_compile_pipeline_lengths(compiled):
    """compile=True on a 2-stage pipeline over 6 batches of new random lengths (padded
    rows): every step's loss is the single process's, and each rank's stage graphs of
    the new shapes run as one template compiled twice (numbers fixed, then symbolic),
    not once per length."""
    ranks = compiled["compile-pp"]["ranks"]
    for r in ranks:
        assert r["ok"], r.get("error")
        assert max(_rel(a, b) for a, b in zip(r["loss"], r["ref"])) < 1e-5, (r["loss"], r["ref"])
        assert r["compiled"] and r["built"] == 6 and r["templates"] == 2, (r["built"], r["templates"])
        assert r["graphs"][-1] == r["graphs"][2], r["graphs"]
