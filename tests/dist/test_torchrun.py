"""The exported module runs unchanged under a real two-node torchrun rendezvous
(``--nnodes 2 --nproc-per-node 2``, both "nodes" on 127.0.0.1) and trains like the
single-process model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import ROOT, free_port


def _export(tmp: Path) -> Path:
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    from autopar import MeshSpec, auto_parallel

    model, ex = gpt.build(layers=2)
    pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2, 2)),
                       pins={"*fc1.weight": "RS(0)", "*fc2.weight": "RS(1)"})
    return pm.export(tmp / "exp")


@pytest.mark.slow  # ~16 s on 2 cores: two torchrun launchers of 2 ranks each
def test_exported_module_under_two_node_torchrun(tmp_path: Path) -> None:
    out = _export(tmp_path)
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", port]
    script = [str(ROOT / "tests/dist/torchrun_load.py"), str(out), "gpt"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([*torchrun, "--node-rank", str(r), *script], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    line = next(x for log in logs for x in log.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["world"] == 4
    for loss, ref in res["losses"]:
        assert loss == pytest.approx(ref, rel=1e-5)
    # two AdamW steps at lr 1e-3: see the tolerance note in test_equivalence.py
    assert res["param_err"] <= 2e-5
