"""The CUDA path on one GPU: NCCL, device per LOCAL_RANK, DTensor parameters on a cuda
mesh.  Under ``torchrun --nproc-per-node 1``: a Hugging Face Llama planned for a mesh
of one, two clipped AdamW steps, a DCP round trip, compared with the same loop on the
CPU.  Prints one ``RESULT {json}`` line.  Run where a GPU is lent:
``torchrun --nproc-per-node 1 benchmarks/gpu_smoke.py``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))


def main() -> None:
    """Run the loop on the GPU and on the CPU; print the differences."""
    import hf_zoo
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import autopar

    model, batch = hf_zoo.build("llama")
    ref = copy.deepcopy(model)
    pm = autopar.auto_parallel(model, example_kwargs=batch, mesh=(1,), search="drec")
    res = {"device": str(pm._mesh_rt.device), "backend": torch.distributed.get_backend(),
           "param_device": str(next(pm.parameters()).device),
           "local_rank": os.environ.get("LOCAL_RANK")}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        out = pm(**batch)  # CPU batch: moved to the device by the module
        out.loss.backward()
        rl = ref(**batch).loss
        rl.backward()
        n = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.1)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        ropt.step()
    res["loss"], res["ref_loss"] = out.loss.item(), rl.item()
    res["norm"], res["ref_norm"] = float(n.full_tensor()), float(rn)
    full = pm.full_state_dict()
    res["param_err"] = max((full[k].cpu() - v).abs().max().item() for k, v in ref.state_dict().items())
    with tempfile.TemporaryDirectory() as d:
        msd, osd = get_state_dict(pm, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
        with torch.no_grad():
            for p in pm.parameters():
                p.zero_()
        msd, osd = get_state_dict(pm, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=d)
        set_state_dict(pm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    back = pm.full_state_dict()
    res["dcp_exact"] = all(torch.equal(back[k], full[k]) for k in full)
    print("RESULT " + json.dumps(res), flush=True)
    pm.shutdown()


if __name__ == "__main__":
    main()
