"""Record real training steps as a Chrome trace, beside the predicted one.

``pm.trace(path)`` is a context manager around ``torch.profiler.profile``: run your
ordinary training steps inside it and call ``t.step()`` after each one::

    with pm.trace("step.json") as t:
        for batch in batches:
            loss = pm(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
            t.step()

Each rank writes its own file (``step.rank0.json``, ``step.rank1.json``, ...) in the
trace-event format that :func:`autopar.timeline.write_trace` writes for the predicted
step, so both open side by side in https://ui.perfetto.dev.  CPU activity is always
recorded (aten ops, gloo collectives); CUDA kernels and NCCL too when the module runs
on a GPU.  Steps are marked ``ProfilerStep#N`` by ``t.step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist


def rank_path(path: str | Path, rank: int) -> Path:
    """``step.json`` -> ``step.rank3.json`` (the suffix kept, the rank before it)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


@contextlib.contextmanager
def trace(path: str | Path, device: torch.device | None = None,
          record_shapes: bool = False) -> Iterator[torch.profiler.profile]:
    """Profile the block and write this rank's Chrome trace to :func:`rank_path`;
    yields the profiler (call ``.step()`` after each training step)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device is not None and device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = rank_path(path, rank)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a schedule that is always active: only with one does step() mark ProfilerStep#N
    always = torch.profiler.schedule(wait=0, warmup=0, active=2**31 - 1)
    with torch.profiler.profile(activities=acts, record_shapes=record_shapes, schedule=always) as prof:
        yield prof
    prof.export_chrome_trace(str(out))


__all__ = ["rank_path", "trace"]
