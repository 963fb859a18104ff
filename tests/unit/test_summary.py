"""The plan summary, layer view, node table and the CLI commands around a saved plan."""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import MeshSpec, Plan
from autopar.cli.main import main
from autopar.plans.roles import axis_roles
from autopar.report.summary import fold_keys, summary_numbers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402

MEGATRON_GPT = {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
                "*q_proj.bias": "S(0)", "*k_proj.bias": "S(0)", "*v_proj.bias": "S(0)",
                "*out_proj.weight": "S(1)", "*out_proj.bias": "R", "*fc1.weight": "S(0)",
                "*fc1.bias": "S(0)", "*fc2.weight": "S(1)", "*fc2.bias": "R"}

# the structure of the summary: the label each line starts with, in order
GOLDEN = ["autopar plan for mesh 2x8 (16 devices, preset multinode-h100-ib, axes a0, a1)",
          "layout", "axis a0", "axis a1", "step time", "throughput", "shapes", "memory", "decisions",
          "pipeline", "micro-batches", "ZeRO", "recompute", "grad buckets", "gathers", "unsupported", "search"]


@pytest.fixture(scope="module")
def llama_plan() -> Plan:
    """A Hugging Face Llama (GQA) from a tiny config, planned for 2 nodes x 8 H100."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=256)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 4096, (16, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (), MeshSpec.preset("multinode-h100-ib", shape=(2, 8)),
                            example_kwargs={"input_ids": ids, "labels": ids})


def test_llama_summary_golden_structure(llama_plan):
    text = llama_plan.summary()
    lines = text.splitlines()
    assert len(lines) <= 40
    labels = [line.strip() for line in lines]
    assert [lab for lab in labels if not any(lab.startswith(g) for g in GOLDEN)] == []
    starts = [next(g for g in GOLDEN if lab.startswith(g)) for lab in labels]
    assert starts == GOLDEN
    # every axis of size > 1 is named with a role and where its ranks sit, in words
    for r in axis_roles(llama_plan):
        assert r.kind in ("DP", "FSDP", "TP", "TP+SP", "SP", "R")
        assert r.link == ("inter-node" if r.name == "a0" else "intra-node")
        assert f"axis {r.name}" in text and r.words() in text
    n = summary_numbers(llama_plan)
    assert re.search(r"[0-9.]+[kMG]? tokens/s \(2048 per step\)", text)
    assert f"MFU {n['mfu'] * 100:.3g}% of 989 TFLOP/s" in text
    # the default budget: the device less the preset's reserve (1.5 GiB + 5% of 80 GiB)
    assert "of 74.5 GiB (80.0 GiB less a 5.5 GiB reserve) per device" in text
    # the gradient buckets: how many, chosen how, and what the two extremes would expose;
    # none where ZeRO reduce-scatters every gradient, whose gathers then say their chunks
    if llama_plan.decisions.grad_buckets:
        assert re.search(r"grad buckets +[0-9]+ gradient buckets? of .*MG-WFBP.*one bucket per "
                         r"gradient would expose [0-9.]+ ms, one bucket for all [0-9.]+ ms", text)
    else:
        assert "grad buckets   no gradient is all-reduced by data parallelism" in text
        assert re.search(r"gathers +ZeRO-2's gathers of the updated parameters in [0-9]+ chunks", text)


def test_summary_numbers_are_consistent(llama_plan):
    n = summary_numbers(llama_plan)
    step = n["step_seconds"]
    assert step == llama_plan.decisions.step_seconds > 0
    # the four parts sum to the step; hidden communication is outside the sum
    assert n["compute_seconds"] + n["exposed_comm_seconds"] + n["bubble_seconds"] + \
        n["optimizer_seconds"] == pytest.approx(step, rel=1e-9)
    # AdamW reads params, grads and two states and writes three back per element: every
    # parameter this device steps (its ZeRO shard: AdamW keeps two states as large),
    # once per step, at the H100's 3.35 TB/s
    held = llama_plan.memory["optimizer"] / 2
    assert n["optimizer_seconds"] == pytest.approx((3 * held + 2 * 2 * held) / 3.35e12, rel=0.05)
    assert n["bubble_seconds"] == 0.0  # no pipeline
    assert n["tokens_per_step"] == 16 * 128 and n["samples_per_step"] == 16
    assert n["tokens_per_second"] == pytest.approx(2048 / step)
    flops = 3 * sum(x.flops for x in llama_plan.nodes.values())
    assert n["model_flops_per_step"] == pytest.approx(flops)
    # at least the matmuls: 6 * params * tokens (embedding excluded) is a lower bound
    assert flops > 0.5 * 6 * (2 * (4 * 256 * 256) + 2 * 3 * 256 * 704) * 2048
    assert n["mfu"] == pytest.approx(flops / (step * 16 * 989e12))
    # the preset's reserve: 1.5 GiB for the runtime plus 5% of 80 GiB for fragmentation
    assert n["memory_budget_bytes"] == 80 * 2**30 * 0.95 - 1.5 * 2**30


def test_json_carries_the_summary_and_reads_back(llama_plan, tmp_path):
    path = tmp_path / "plan.json"
    llama_plan.to_json(path)
    d = json.loads(path.read_text())
    assert d["summary"]["layout"] == summary_numbers(llama_plan)["layout"]
    for key in ("step_seconds", "tokens_per_second", "model_flops_per_step", "memory_budget_bytes"):
        assert key in d["summary"]
    assert d["request"]["mesh_shape"] == [2, 8]
    again = Plan.from_json(path)
    assert again.request == llama_plan.request
    assert again.summary() == llama_plan.summary()


def test_tensor_parallel_pins_read_as_tp_with_col_and_row():
    model, ex = gpt.build(layers=2)
    p = autopar.plan(model, ex, (2,), pins=MEGATRON_GPT)
    assert [r.kind for r in axis_roles(p)] == ["TP"]
    view = p.table(width=300)  # wide enough that no cell wraps
    assert "blocks.0-1 x2" in view  # identical blocks folded
    assert "q_proj/k_proj/v_proj/fc1 col; out_proj/fc2 row; " in view


def test_pipeline_and_data_parallel_roles_and_parts_sum():
    model, ex = gpt.build(layers=2)
    p = autopar.plan(model, ex, (4,), pipeline_stages=2, micro_batches=4, schedule="1f1b",
                     pins={"*": "R", "input:0": "S(0)"})
    roles = axis_roles(p)
    assert [(r.kind, r.size) for r in roles] == [("PP", 2), ("DP", 2)]
    b = p.decisions.breakdown
    assert b["bubble_seconds"] > 0
    assert b["compute_seconds"] + b["exposed_comm_seconds"] + b["bubble_seconds"] + \
        b["optimizer_seconds"] == pytest.approx(p.decisions.step_seconds, rel=1e-9)
    text = p.summary()
    assert "layout         PP2 (one host; 1f1b, 4 micro-batches)" in text
    assert re.search(r"stages         0: pre, blocks\.0(-1)?(, blocks\.1)?; 1: ", text)
    dp = autopar.plan(model, ex, (2,), pins={"input:0": "S(0)", "input:1": "S(0)", "*weight": "R"})
    assert [r.kind for r in axis_roles(dp)] == ["DP"]


def test_fold_keys():
    assert fold_keys(["pre", "h.0", "h.1", "h.2", "post"]) == ["pre", "h.0-2", "post"]
    assert fold_keys(["a.0", "a.2", "b.3"]) == ["a.0", "a.2", "b.3"]
    assert fold_keys(["model.layers.4"]) == ["model.layers.4"]


def test_node_table_tsv_and_legend():
    model, ex = gpt.build(layers=1)
    p = autopar.plan(model, ex, (2,))
    tsv = p.table(nodes=True, fmt="tsv").splitlines()
    assert all(len(row.split("\t")) == 8 for row in tsv)
    assert tsv[0].split("\t")[0] == "node" and any(r.startswith("tok.weight\t") for r in tsv)
    text = p.table(nodes=True, width=200)
    assert "S(d) = tensor dim d split" in text and "blocks.0.attn.q_proj.weight" in text


def test_explain_deltas_are_against_the_chosen_strategy():
    model, ex = gpt.build(layers=1)
    p = autopar.plan(model, ex, (2,))
    n = next(x for x in p.nodes.values() if x.op == "linear" and x.alternatives)
    text = p.explain(n.name)
    assert "vs chosen" in text
    for a in n.alternatives:
        # the chosen strategy is optimal with its neighbours fixed: no alternative is cheaper
        assert a.seconds >= n.local_seconds - 1e-12
    with pytest.raises(KeyError, match="did you mean"):
        p.explain(n.name + "9")
    with pytest.raises(KeyError, match="decisions: buckets, compile, compression, copies, gathers, "
                                       "micro_batches, offload, pipeline, recompute, zero, shapes"):
        p.explain("nothing_like_it")


class _NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumprod(self.fc(x), dim=-1).sum()  # an op with no rule


def test_warnings_point_at_the_users_call():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = autopar.plan(_NoRule(), (torch.randn(4, 8),), (2,))
    mine = [w for w in caught if "no sharding rule" in str(w.message)]
    assert mine and all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]
    assert p.summary().count("aten.cumprod") == 1


def test_progress_lines_when_not_a_terminal(capsys):
    model, ex = gpt.build(layers=1)
    autopar.plan(model, ex, (2,), progress=True)
    err = capsys.readouterr().err
    for phase in ("capturing the model", "placing ops", "solving the placement ILP", "chose"):
        assert phase in err
    assert all(line.startswith("[autopar") for line in err.splitlines() if line)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


GPT = str(ROOT / "examples" / "gpt.py")
SMALL = ["--factory-args", "layers=1", "dim=32", "heads=2", "vocab=64", "seq=8", "batch=4"]


def test_cli_version_presets_explain_diff(capsys, tmp_path, monkeypatch):
    # the tables size themselves to COLUMNS (pytest-xdist's workers set 80, where the
    # presets table wraps "989" and "80.0 GiB" inside their cells): a wide terminal here
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = run(capsys, "--version")
    assert code == 0 and re.match(r"autopar \S+ \(torch \S+, plan schema \d+\)", out)
    code, out, _ = run(capsys, "presets")
    assert code == 0
    for name in autopar.cost_models.PRESET_NAMES:
        assert name in out
    assert "989" in out and "80.0 GiB" in out
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--json", str(a), "-q", *SMALL)[0] == 0
    assert run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--json", str(b), "-q",
               "--pipeline-stages", "2", "--micro-batches", "2", *SMALL)[0] == 0
    code, out, _ = run(capsys, "explain", str(a))
    assert code == 0 and out.startswith("autopar plan for mesh 2") and "why:" in out
    code, out, _ = run(capsys, "explain", str(a), "zero", "tok.weight")
    assert code == 0 and "ZeRO" in out and "tok_weight" in out
    code, _, err = run(capsys, "explain", str(a), "blocks.9")
    assert code == 2 and "did you mean blocks.0" in err
    code, out, _ = run(capsys, "diff", str(a), str(b))
    assert code == 0
    assert "pipeline_stages A 1, B 2" in out and "B/A" in out and "differ" in out
    code, _, err = run(capsys, "diff", str(a), str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err


def test_cli_formats_and_verbosity(capsys):
    code, out, _ = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--format", "tsv", *SMALL)
    assert code == 0 and all(len(line.split("\t")) == 8 for line in out.strip().splitlines())
    code, out, _ = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--format", "json", *SMALL)
    assert code == 0 and json.loads(out)["summary"]["world_size"] == 2
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "-q", *SMALL)
    assert code == 0 and "planned in" not in out and "[autopar" not in err
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--progress", *SMALL)
    assert code == 0 and "[autopar" in err and "planned in" in out
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "-vv", *SMALL)
    assert code == 0 and "INFO autopar: solving the placement ILP" in err
    assert math.isfinite(float(re.search(r"planned in ([0-9.]+) s", out).group(1)))


def test_layer_view_splits_compute_and_communication_per_layer():
    """Issue 12: the layer table says what a profiler would show per layer, predicted
    compute and communication apart.  Megatron pins put the blocks' all-reduces in their
    comm column and the columns add up to the plan's node prices; with data parallel the
    blocks communicate nothing themselves and the gradient sync line says what hides."""
    from autopar.report.summary import _fold, _layer_rows

    model, ex = gpt.build(layers=2, dim=64)
    mesh = MeshSpec.preset("cpu-gloo", shape=(2,))
    tp = autopar.plan(model, ex, mesh, pins=MEGATRON_GPT)
    rows = {r[0]: r for r in _layer_rows(tp)}
    ops = [n for n in tp.nodes.values() if n.kind == "op"]
    assert sum(r[2] for r in rows.values()) == pytest.approx(sum(n.compute - n.own_comm for n in ops))
    assert sum(r[3] for r in rows.values()) == pytest.approx(sum(n.comm + n.own_comm for n in ops))
    assert rows["blocks.0"][3] > 0 and rows["blocks.0"][2] > 0
    folded = _fold(list(rows.values()))
    assert [r[0] for r in folded] == ["pre", "blocks.0-1 x2", "post"]
    header = tp.table(width=300).splitlines()[2]  # wide enough that the title never wraps
    assert "compute" in header and "comm" in header
    dp = autopar.plan(model, ex, mesh, pins={"*": "R", "input:0": "S(0)", "input:1": "S(0)"})
    assert {r[0]: r for r in _layer_rows(dp)}["blocks.0"][3] == 0
    # the preset's link keeps 0.35 of its speed beside compute: part of the sync hides
    assert dp.decisions.breakdown["hidden_comm_seconds"] > 0
    assert "hidden under backward" in dp.table()
