"""The ``autopar`` command line, run in-process through :func:`autopar.cli.main`."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar import Plan
from autopar.cli.args import parse_bytes
from autopar.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.py")
GPT = str(ROOT / "examples" / "gpt.py")
GPT_SMALL = ["--factory-args", "layers=1", "dim=32", "heads=2", "vocab=64", "seq=8", "batch=4"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def mlp_plan_json(tmp_path_factory):
    """One planned MLP on a 2x2 mesh, shared by the tests that only read its output."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("cli") / "mlp.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", f"{MLP}:build", "--mesh", "2x2", "--json", str(path), "--nodes",
                     "--explain", "fc1.weight"])
    return code, out.getvalue(), err.getvalue(), path


def test_mlp_2x2_table_json_and_explain(mlp_plan_json):
    code, out, err, path = mlp_plan_json
    assert code == 0, err
    assert "autopar plan for mesh 2x2 (4 devices" in out
    assert "nodes of the plan for mesh 2x2" in out  # --nodes: the node table after the summary
    for name in ("fc1.weight", "fc2.weight", "fc3.bias", "linear", "mse_loss"):
        assert name in out
    p = Plan.from_json(path)
    assert p.mesh.shape == (2, 2)
    # every placement the table prints for a parameter is the one in the JSON
    for fqn, placement in p.params().items():
        row = next(line for line in out.splitlines() if f" {fqn} " in line)
        assert placement in row
        assert len(placement.replace("S(0)", "S").replace("S(1)", "S")) == 2
    assert "chosen: inputs" in out  # --explain
    assert f"plan written to {path}" in out


def test_json_round_trip_matches(mlp_plan_json):
    _, _, _, path = mlp_plan_json
    p = Plan.from_json(path)
    again = Plan.from_json(p.to_json())
    assert again.to_dict() == p.to_dict()
    assert set(p.timings) >= {"capture", "annotate", "enumerate_and_price", "solve"}


def test_mlp_1d_mesh_with_pin(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", f"{MLP}:build", "--mesh", "2", "--pin", "fc1.weight=S(0)",
                         "--json", str(out_json), "--memory-budget", "1GiB", "--time-limit", "10")
    assert code == 0, err
    assert "autopar plan for mesh 2 (2 devices" in out
    p = Plan.from_json(out_json)
    assert p.placement("fc1.weight") == "S(0)"


def test_collectives_listed_per_step(capsys):
    code, out, err = run(capsys, "plan", f"{MLP}:build", "--mesh", "2", "--pin", "*=R",
                         "--pin", "input:0=S(0)", "--pipeline-stages", "1", "--collectives")
    assert code == 0, err
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("0 ")]
    # data parallel: the gradients are all-reduced in backward, over both ranks
    assert any(r[1:4] == ["backward", "all_reduce", "2"] and "gradient" in r for r in rows), out
    assert "stage 0:" in out


def test_mesh_json_reshaped(capsys, tmp_path):
    from autopar import MeshSpec

    mesh_file = tmp_path / "mesh.json"
    MeshSpec.preset("8xH100-nvlink").to_json(mesh_file)
    out_json = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", f"{MLP}:build", "--mesh-json", str(mesh_file),
                         "--mesh", "2x2", "--json", str(out_json))
    assert code == 0, err
    p = Plan.from_json(out_json)
    assert p.mesh.shape == (2, 2) and p.mesh.name == "8xH100-nvlink"


@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_gpt_small(capsys, tmp_path, mesh):
    out_json = tmp_path / "gpt.json"
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", mesh, "--json", str(out_json),
                         "--nodes", *GPT_SMALL)
    assert code == 0, err
    p = Plan.from_json(out_json)
    assert p.mesh.shape == tuple(int(x) for x in mesh.split("x"))
    assert "tok.weight" in out and "blocks.0.attn.q_proj.weight" in out
    assert p.placement("tok.weight") in out
    assert "planned in" in out


def test_factory_defaults_to_build_and_example_inputs(capsys, tmp_path):
    f = tmp_path / "only_model.py"
    f.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(8, 4)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x).sum()\n"
        "def make(width=8):\n"
        "    return M()\n"
        "def example_inputs():\n"
        "    return torch.randn(4, 8)\n"
    )
    code, out, err = run(capsys, "plan", f"{f}:make", "--mesh", "2", "--nodes")
    assert code == 0, err
    assert "fc.weight" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "does/not/exist.py:build"], "no such file: does/not/exist.py"),
    (["plan", f"{MLP}:biuld"], "has no factory 'biuld'; did you mean build"),
    (["plan", f"{MLP}:build", "--preset", "8xA100"], "unknown preset '8xA100'"),
    (["plan", f"{MLP}:build", "--mesh", "2y4"], "bad --mesh '2y4'"),
    (["plan", f"{MLP}:build", "--mesh", "0"], "bad --mesh '0'"),
    (["plan", f"{MLP}:build", "--mesh", "16", "--preset", "8xA100-nvlink"], "one node of 8"),
    (["plan", f"{MLP}:build", "--pin", "fc1.weight=Q"], "cannot parse placements 'Q'"),
    (["plan", f"{MLP}:build", "--pin", "fc1.weight"], "must look like NAME=VALUE"),
    (["plan", f"{MLP}:build", "--memory-budget", "lots"], "cannot parse memory size 'lots'"),
    (["plan", f"{MLP}:build", "--factory-args", "width=3"], "unexpected keyword argument 'width'"),
    (["plan", f"{MLP}:build", "--mesh-json", "/no/such/mesh.json"], "no such mesh file"),
    (["plan", f"{MLP}:build", "--time-limit", "0"], "--time-limit must be > 0"),
])
def test_user_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert err.strip().startswith("autopar: error:")


@pytest.mark.parametrize("argv, message", [
    (["plan", f"{MLP}:build", "--mesh", "2x2", "--pin", "nothere=RR"],
     "PlanError: pin 'nothere' names no parameter"),
    (["plan", f"{MLP}:build", "--mesh", "2", "--pin", "fc1.weight=RR"], "2 placements for a 1-axis"),
    (["plan", f"{MLP}:build", "--mesh", "2", "--memory-budget", "1KiB"], "memory budget"),
    (["plan", f"{MLP}:build", "--mesh", "2", "--explain", "no_such_node"],
     "--explain no_such_node: no node, parameter, layer or decision"),
])
def test_autopar_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_loading_error_is_reported(capsys, tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import no_such_module_for_autopar\n")
    code, _, err = run(capsys, "plan", f"{f}:build")
    assert code == 2
    assert "loading" in err and "ModuleNotFoundError" in err


def test_factory_returning_wrong_thing(capsys, tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def build():\n    return 3\n")
    code, _, err = run(capsys, "plan", f"{f}:build")
    assert code == 2 and "must return (model, example_inputs)" in err


def test_usage_errors(capsys):
    assert main([]) == 2
    assert main(["plan"]) == 2
    assert "usage" in capsys.readouterr().err
    assert main(["plan", "--help"]) == 0
    assert "--memory-budget" in capsys.readouterr().out


def test_hf_offline_default(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    main(["plan", "does/not/exist.py"])
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("text, value", [
    ("40GiB", 40 * 2**30), ("512MiB", 512 * 2**20), ("80GB", 80e9), ("4e10", 4e10),
    ("1.5 G", 1.5 * 2**30), ("100", 100.0),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


# ---------------------------------------------------------------- plan-level decisions
GPT_TWO = ["--factory-args", "layers=2", "dim=32", "heads=2", "vocab=64", "seq=8", "batch=4"]


def test_decision_flags_map_onto_plan_options():
    from autopar.cli.args import decision_options
    from autopar.cli.main import build_parser

    args = build_parser().parse_args(
        ["plan", "m.py", "--zero-stage", "3", "--pipeline-stages", "2", "--micro-batches", "4",
         "--schedule", "1f1b", "--recompute", "blocks.0,blocks.1", "--recompute", "blocks.3",
         "--explore", "--precision", "bf16-mixed", "--batch", "local"])
    assert decision_options(args) == {
        "zero_stage": 3, "pipeline_stages": 2, "micro_batches": 4, "schedule": "1f1b",
        "recompute": ["blocks.0", "blocks.1", "blocks.3"], "explore": True,
        "precision": "bf16-mixed", "batch": "local"}
    # nothing given: nothing forced, the search chooses everything
    assert decision_options(build_parser().parse_args(["plan", "m.py"])) == {}
    # "none" forces no recomputation (an empty list), unlike leaving the flag out
    assert decision_options(build_parser().parse_args(
        ["plan", "m.py", "--recompute", "none", "--zero-stage", "0"])) == {"recompute": [],
                                                                          "zero_stage": 0}


def test_forced_pipeline_micro_batches_and_recompute(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--pipeline-stages", "2",
                         "--micro-batches", "4", "--schedule", "gpipe", "--recompute", "blocks.1",
                         "--zero-stage", "0", "--json", str(out_json), "--explain", "--explain",
                         "pipeline", "--max-rows", "2", *GPT_TWO)
    assert code == 0, err
    d = Plan.from_json(out_json).decisions
    assert (d.pipeline_stages, d.micro_batches, d.schedule, d.recompute, d.zero_stage) == \
        (2, 4, "gpipe", ["blocks.1"], 0)
    # the summary states the layout and the stages, then the reasons (bare --explain)
    assert "layout         PP2 (one host; gpipe, 4 micro-batches)" in out
    assert "stages         0: pre, blocks.0; 1: blocks.1, post" in out
    assert "1 layer recomputed (blocks.1)" in out
    why = out[out.index("why:"):]
    assert "  pipeline: " in why and "  layer:blocks.1: " in why
    # in the summary's decisions, in the bare --explain list, and for --explain pipeline
    assert out.count(d.why["pipeline"]) == 3


def test_forced_zero_on_data_parallel_mesh(capsys):
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "--zero-stage", "2",
                         "--pipeline-stages", "1", "--micro-batches", "1", "--recompute", "none",
                         "--pin", "*=R", "--pin", "input:0=S(0)", "--max-rows", "1", *GPT_TWO)
    assert code == 0, err
    # "*=R" pins the parameters replicated and the batch is split: data parallel with
    # ZeRO-2 (the batch was gathered and every op replicated while the loss's
    # all-reduces were priced on the step's path; they are off it now)
    assert "layout         DP2 (one host), ZeRO-2" in out
    assert "ZeRO-2 over mesh axis 0" in out and "no pipeline" in out
    assert "no layer is recomputed" in out


@pytest.mark.parametrize("argv, message", [
    (["--micro-batches", "0"], "--micro-batches must be >= 1"),
    (["--pipeline-stages", "0"], "--pipeline-stages must be >= 1"),
    (["--pipeline-stages", "1", "--schedule", "1f1b"], "--schedule 1f1b needs a pipeline"),
    (["--recompute", "none,blocks.0"], "--recompute none cannot be combined"),
    (["--recompute", "blocks.0,,blocks.1"], "empty layer key"),
])
def test_decision_flag_errors_before_planning(capsys, argv, message):
    code, _, err = run(capsys, "plan", "does/not/matter.py", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_decision_flag_choices_are_checked_by_argparse(capsys):
    assert main(["plan", f"{GPT}:build", "--zero-stage", "4"]) == 2
    assert "invalid choice: 4" in capsys.readouterr().err
    assert main(["plan", f"{GPT}:build", "--schedule", "interleaved"]) == 2
    assert "invalid choice: 'interleaved'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--recompute", "blocks.9"], "recompute names unknown layer(s) ['blocks.9']"),
    (["--pipeline-stages", "3"], "3 pipeline stages do not divide any axis of the mesh (2,)"),
    (["--pipeline-stages", "2", "--pipeline-axis", "1"], "pipeline_axis must be an axis of the mesh (2,)"),
])
def test_decision_errors_found_by_planning(capsys, argv, message):
    code, _, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", *argv, *GPT_TWO)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_verbose_run_leaves_no_handler_behind(capsys):
    # before: `plan -vv` left a handler on that run's stderr; a later run in the same
    # process (a notebook, the next test) printed "--- Logging error ---" tracebacks
    # into its output once that stream was closed
    import logging

    run(capsys, "plan", f"{GPT}:build", "--mesh", "2", "-vv", *GPT_SMALL)
    code, out, err = run(capsys, "plan", f"{GPT}:build", "--mesh", "2", *GPT_SMALL)
    assert code == 0
    # (within one test the first stream is still open: the old handler printed there)
    assert "INFO autopar" not in err and "DEBUG autopar" not in err, err[:400]
    log = logging.getLogger("autopar")
    assert not [h for h in log.handlers if getattr(h, "_autopar_cli", False)]
    assert log.propagate and log.level == logging.NOTSET
