"""Record real training steps as a Chrome trace, beside the predicted one.

``pm.trace(path)`` is a context manager around ``torch.profiler.profile``: run your
ordinary training steps inside it and call ``t.step()`` after each one::

    with pm.trace("step.json") as t:
        for batch in batches:
            loss = pm(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
            t.step()

Each rank writes its own file (``step.rank0.json``, ``step.rank1.json``, ...) in the
trace-event format that :func:`autopar.report.timeline.write_trace` writes for the predicted
step, so both open side by side in https://ui.perfetto.dev.  CPU activity is always
recorded (aten ops, gloo collectives); CUDA kernels and NCCL too when the module runs
on a GPU.  Steps are marked ``ProfilerStep#N`` by ``t.step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


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


@dataclass(frozen=True)
class Issued:
    """One collective a rank issued: its kind (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all``, ``send``, ``recv``, ``broadcast``), the ranks of
    its group and the bytes this rank put in."""

    kind: str
    group: int
    bytes: int


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# torch.distributed function -> (kind, which argument is this rank's input)
_RECORDED = {"all_reduce": ("all_reduce", 0), "all_gather": ("all_gather", 1),
             "all_gather_into_tensor": ("all_gather", 1), "all_gather_single": ("all_gather", 1),
             "reduce_scatter_tensor": ("reduce_scatter", 1),
             "reduce_scatter_single": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
             "all_to_all_single": ("all_to_all", 1), "isend": ("send", 0), "send": ("send", 0),
             "irecv": ("recv", 0), "recv": ("recv", 0), "broadcast": ("broadcast", 0)}


@contextlib.contextmanager
def collective_log() -> Iterator[list[Issued]]:
    """Record every ``torch.distributed`` collective and point-to-point message this
    process issues inside the block (what :meth:`autopar.plans.Plan.collectives`
    predicts for a step); yields the list it appends to.  It wraps the module-level
    functions, through which the generated code and the runtime issue every one;
    DTensor's functional collectives (e.g. in ``clip_grad_norm_``) are not recorded.
    ``batch_isend_irecv`` calls the ``isend``/``irecv`` its ``P2POp`` s were built
    with, so each of its messages counts once."""
    log: list[Issued] = []
    real = {name: getattr(dist, name) for name in _RECORDED if hasattr(dist, name)}

    def wrap(name: str):
        kind, arg = _RECORDED[name]

        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            t = args[arg] if len(args) > arg else None
            log.append(Issued(kind, dist.get_world_size(group) if kind not in ("send", "recv")
                              else 2, _nbytes(t)))
            return real[name](*args, **kwargs)
        return recorded

    wrapped = {name: wrap(name) for name in real}
    # P2POp checks its op against c10d's own isend/irecv: wrap those the same way
    p2p = {name: getattr(c10d, name) for name in ("isend", "irecv")}
    for name, fn in wrapped.items():
        setattr(dist, name, fn)
    for name in p2p:
        setattr(c10d, name, wrapped[name])
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        for name, fn in p2p.items():
            setattr(c10d, name, fn)


__all__ = ["Issued", "collective_log", "rank_path", "trace"]
