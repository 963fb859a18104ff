"""Launching from a plan: torchrun (``autopar run``), SLURM and Kubernetes (``autopar launch``).

The sbatch script and ``autopar run`` really start gloo jobs on this machine (two
"nodes" on 127.0.0.1 for SLURM, through a stand-in ``srun`` that starts the script's
command once per node as SLURM would); the PyTorchJob is checked against a snapshot of
the PyTorchJob CRD's schema (tests/fixtures/pytorchjob_schema.json, its source in
its ``$comment``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import autopar
from autopar.cli.launch import (
    LaunchError,
    Layout,
    layout_for,
    pytorchjob,
    pytorchjob_yaml,
    slurm_script,
    torchrun_argv,
)
from autopar.cli.main import main
from tests.dist.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import mlp  # noqa: E402

SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "pytorchjob_schema.json").read_text())

PAYLOAD = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(r)])
dist.all_reduce(t)
node = os.environ.get("SLURM_NODEID", "-")
open(os.path.join(sys.argv[1], f"rank{r}.txt"), "w").write(f"{w} {t.item()} {node} {sys.argv[2]}")
dist.destroy_process_group()
"""

FAKE_SRUN = """#!/bin/bash
# stand-in for srun: start the command once per node, in parallel, as SLURM does
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A 16-rank plan on 2 nodes of 8 H100s and a 2-rank cpu-gloo plan, as JSON files."""
    d = tmp_path_factory.mktemp("plans")
    model, ex = mlp.build()
    h = autopar.plan(model, ex, autopar.MeshSpec.preset("multinode-h100-ib", shape=(2, 8)))
    c = autopar.plan(model, ex, (2,))
    h.to_json(d / "h100.json")
    c.to_json(d / "cpu.json")
    return {"h100": h, "cpu": c, "dir": d}


def test_layout_from_the_plan(plans):
    assert layout_for(plans["h100"]) == Layout(2, 8)
    assert layout_for(plans["cpu"]) == Layout(1, 2)
    assert layout_for(plans["h100"], nnodes=4) == Layout(4, 4)
    assert layout_for(plans["h100"], nproc_per_node=16) == Layout(1, 16)
    with pytest.raises(LaunchError, match=r"= 24 ranks, but the plan was made for 16"):
        layout_for(plans["h100"], nnodes=3, nproc_per_node=8)
    with pytest.raises(LaunchError, match="does not divide"):
        layout_for(plans["h100"], nproc_per_node=3)
    with pytest.raises(LaunchError, match="give --plan"):
        layout_for(None)
    argv = torchrun_argv(Layout(2, 8), "t.py", ["--x"], rdzv_endpoint="h:1")
    assert argv[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "autopar",
                        "t.py", "--x"]
    with pytest.raises(LaunchError, match="rdzv-endpoint"):
        torchrun_argv(Layout(2, 8), "t.py")


def test_sbatch_script_is_valid_bash_and_sized_by_the_plan(plans, tmp_path):
    text = slurm_script(plans["h100"], "train.py", ["--name", "a b"], partition="gpu", time="01:00:00")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert "--nproc-per-node 8" in text and "'a b'" in text and "#SBATCH --partition=gpu" in text
    f = tmp_path / "job.sbatch"
    f.write_text(text)
    assert subprocess.run(["bash", "-n", str(f)]).returncode == 0


@pytest.mark.slow  # ~6 s on 2 cores: two launchers of two ranks each
def test_sbatch_script_runs_two_nodes_locally(plans, tmp_path):
    """The generated script, run as sbatch would (SLURM_* set, srun on PATH): 2 nodes x 1
    rank each rendezvous on 127.0.0.1 and all-reduce."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "payload.py").write_text(PAYLOAD)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sbatch"
    code = main(["launch", "--slurm", str(plans["dir"] / "cpu.json"), "--nnodes", "2",
                 "--nproc-per-node", "1", "--python", sys.executable, "-o", str(script), "--",
                 str(tmp_path / "payload.py"), str(out), "x y"])
    assert code == 0
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1",
           "AUTOPAR_RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    got = sorted((out / f"rank{r}.txt").read_text() for r in range(2))
    # world 2, sum of ranks 1, one rank per node, the quoted argument arrived whole
    assert [g.split(" ", 3)[:2] for g in got] == [["2", "1.0"], ["2", "1.0"]]
    assert sorted(g.split(" ")[2] for g in got) == ["0", "1"]
    assert all(g.endswith("x y") for g in got)
    # the script refuses a job with the wrong node count
    bad = subprocess.run(["bash", str(script)], env={**env, "SLURM_NNODES": "3"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "the plan needs 2 nodes, this job has 3" in bad.stderr


def _validate(job: dict) -> None:
    import jsonschema

    jsonschema.validate(job, SCHEMA)


def test_pytorchjob_validates_against_the_crd_schema(plans, capsys, tmp_path):
    job = pytorchjob(plans["h100"], "train.py", ["--steps", "10"], image="reg/train:1", name="llama")
    _validate(job)
    assert job["spec"]["nprocPerNode"] == "8"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    c = specs["Worker"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["torchrun", "train.py", "--steps", "10"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    # the CLI writes the same job as YAML
    out = tmp_path / "job.yaml"
    assert main(["launch", "--k8s", str(plans["dir"] / "h100.json"), "--image", "reg/train:1",
                 "--name", "llama", "-o", str(out), "--", "train.py", "--steps", "10"]) == 0
    assert yaml.safe_load(out.read_text()) == job
    # the check can fail: a misspelled field and a wrong type are rejected
    import jsonschema

    bad = json.loads(json.dumps(job))
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        _validate(bad)
    bad = json.loads(json.dumps(job))
    bad["spec"]["nprocPerNode"] = 8
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)
    # YAML 1.2 (Kubernetes) would read a bare 1e-3 as a number: every string is quoted
    text = pytorchjob_yaml(pytorchjob(plans["h100"], "t.py", ["--lr", "1e-3", "0x10"], image="i"))
    assert '"1e-3"' in text and '"0x10"' in text
    assert yaml.safe_load(text)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["command"][-3:] == ["--lr", "1e-3", "0x10"]
    with pytest.raises(LaunchError, match="#SBATCH line"):
        slurm_script(plans["h100"], "t.py", partition="gpu\n#SBATCH --nodes=99")
    with pytest.raises(LaunchError, match="not a Kubernetes name"):
        pytorchjob(plans["h100"], "t.py", image="i", name="Llama_1")
    assert main(["launch", "--k8s", str(plans["dir"] / "h100.json"), "--", "t.py"]) == 2
    assert "--image is required" in capsys.readouterr().err


@pytest.mark.slow  # two torchrun start-ups: ~15 s on two cores
def test_autopar_run_checks_and_really_runs(plans, tmp_path):
    (tmp_path / "payload.py").write_text(PAYLOAD)
    exe = Path(sys.executable).parent / "autopar"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bad = subprocess.run([str(exe), "run", "--plan", str(plans["dir"] / "cpu.json"),
                          "--nproc-per-node", "3", str(tmp_path / "payload.py")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "the plan runs on 2 ranks" in bad.stderr
    p = subprocess.run([str(exe), "run", "--plan", str(plans["dir"] / "cpu.json"),
                        str(tmp_path / "payload.py"), str(tmp_path), "z"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--standalone --nproc-per-node 2" in p.stderr
    assert sorted((tmp_path / f"rank{r}.txt").read_text().split(" ")[:2] == ["2", "1.0"]
                  for r in range(2)) == [True, True]


def test_elastic_jobs(plans, tmp_path):
    """--elastic MIN: SLURM takes MIN-MAX nodes and keeps the job when one fails, torchrun
    re-forms the job over what is left (tests/dist/test_elastic.py runs that), and the
    PyTorchJob is the operator's elastic form, valid against its CRD."""
    text = slurm_script(plans["h100"], "train.py", elastic=1)
    assert "#SBATCH --nodes=1-2" in text and "#SBATCH --no-kill" in text
    assert '--nnodes "1:$SLURM_NNODES" --max-restarts 3' in text
    f = tmp_path / "job.sbatch"
    f.write_text(text)
    assert subprocess.run(["bash", "-n", str(f)]).returncode == 0
    # outside its range the script refuses before srun
    env = {**os.environ, "SLURM_NNODES": "3", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "127.0.0.1"}
    bad = subprocess.run(["bash", str(f)], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "runs on 1 to 2 nodes, this one has 3" in bad.stderr
    job = pytorchjob(plans["h100"], "train.py", image="reg/train:1", elastic=1)
    _validate(job)
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 2,
                                            "maxRestarts": 3}
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    for bad_min in (0, 3):
        with pytest.raises(LaunchError, match="--elastic"):
            slurm_script(plans["h100"], "train.py", elastic=bad_min)
    # without it, nothing changes: a fixed job
    assert "--no-kill" not in slurm_script(plans["h100"], "train.py")
    assert "elasticPolicy" not in pytorchjob(plans["h100"], "train.py", image="i")["spec"]
