"""What tests/dist/test_elastic.py runs under torchrun: examples/gpt.py (2 layers) trained
with autopar.save_checkpoint after every step and autopar.load_checkpoint at start, the
whole batch on every rank (batch="global"), a pause after each step so a node can be
lost mid-run.  Usage: elastic_train.py STEPS CKPT_DIR."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

import autopar  # noqa: E402


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same in every world."""
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, 256, (8, 32), generator=g)
    return t, torch.roll(t, -1, dims=1)


def main() -> None:
    steps, ckpt = int(sys.argv[1]), sys.argv[2]
    model, _ = gpt.build(layers=2, dim=64, heads=4, seq=32, batch=8)
    pm = autopar.auto_parallel(model, example_inputs=batch(0), timeout=30)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    saved = autopar.load_checkpoint(pm, opt, ckpt)
    step = saved["step"] if saved else 0
    print(f"rank {pm.rank} world {dist.get_world_size()} starts at step {step}", flush=True)
    while step < steps:
        step += 1
        opt.zero_grad()
        loss = pm(*batch(step))
        loss.backward()
        opt.step()
        autopar.save_checkpoint(pm, opt, ckpt, step=step)
        if pm.rank == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.3")))
    pm.shutdown()


if __name__ == "__main__":
    main()
