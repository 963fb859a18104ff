"""Run under torchrun: load an exported module, train two steps, compare with the
single-process model built the same way; rank 0 prints RESULT <json>."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))


def main() -> None:
    import importlib

    import autopar

    directory, model_name = sys.argv[1], sys.argv[2]
    pm = autopar.load(directory)
    model, ex = importlib.import_module(model_name).build(layers=2) if model_name == "gpt" else \
        importlib.import_module(model_name).build()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        loss = pm(*ex)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = model(*ex)
        ref.backward()
        ropt.step()
        ropt.zero_grad()
        losses.append((loss.item(), ref.item()))
    full = pm.full_state_dict()
    err = max((full[k] - v).abs().max().item() for k, v in model.state_dict().items())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"losses": losses, "param_err": err,
                                      "world": dist.get_world_size(),
                                      "node_rank": int(os.environ.get("GROUP_RANK", -1))}))
    pm.shutdown()


if __name__ == "__main__":
    main()
