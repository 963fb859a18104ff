"""Faults of one rank while planning, on real gloo ranks (run by test_rank_faults.py).
Every rank runs each case and returns what it saw: the error type, message, seconds."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from autopar import MeshSpec, auto_parallel
from autopar.runtime import agree
from autopar.runtime.mesh import reset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def _attempt(**kw) -> dict:
    import mlp

    model, ex = mlp.build()
    reset()
    t0 = time.perf_counter()
    try:
        auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)), **kw)
        return {"rank": dist.get_rank(), "error": None, "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - the case reports what each rank saw
        return {"rank": dist.get_rank(), "error": type(e).__name__, "message": str(e),
                "seconds": time.perf_counter() - t0}


def run(c: dict) -> dict:
    """``plan_error``: a pin rank 0's planner refuses; ``silent``: rank ``c["silent"]``
    does not call auto_parallel for a while (it sleeps).  Each rank writes what it saw
    to ``c["dir"]/<id>-<rank>.json``: after a silent rank the group may be unusable."""
    import json

    agree._CALLS[0] = 1000 * c["index"]
    if c["fn"] == "plan_error":
        mine = _attempt(pins={"nope.weight": "R"})
    elif dist.get_rank() == c["silent"]:
        time.sleep(c["sleep"])
        mine = {"rank": dist.get_rank(), "error": "slept", "seconds": c["sleep"]}
    else:
        mine = _attempt(timeout=c["timeout"])
    Path(c["dir"], f"{c['id']}-{dist.get_rank()}.json").write_text(json.dumps(mine))
    return mine
