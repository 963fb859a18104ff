"""autopar: automatic parallelization planning for PyTorch.

``auto_parallel(model, example_inputs=..., mesh=MeshSpec.preset(...))`` captures the
model, searches data, tensor and ZeRO-style sharding jointly under a cost model, and
returns a module whose forward issues the collectives the plan needs.
"""

import warnings

from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.report  # noqa: F401  (registers how a Plan prints and explains itself)
from autopar.api import LazyParallel, auto_parallel, plan
from autopar.cost_models import MeshSpec
from autopar.errors import (
    AutoparError,
    AutoparWarning,
    CallMismatchError,
    CaptureError,
    CompileFallbackWarning,
    ExportError,
    LoadError,
    MeshMismatchError,
    PlanError,
)
from autopar.module.checkpoint import load_checkpoint, save_checkpoint
from autopar.module.load import load_module
from autopar.module.parallel import ParallelModule
from autopar.plans.data import Plan
from autopar.verify import verify

# autopar's own warnings show with every plan (the default filter shows a text once per
# process: a second identical plan would hide its fallbacks); users can still filter them
warnings.filterwarnings("always", category=AutoparWarning)


def load(directory, batch: str = "global", timeout: float = 600.0) -> ParallelModule:
    """Load a module written by :meth:`ParallelModule.export` (under torchrun: collective).

    Only a complete export loads: its ``MANIFEST.json`` (written last) must be there and
    every file this rank reads must match its recorded sha256.  A missing, truncated or
    corrupt file, another autopar schema, an unknown key or a placement that does not fit
    the mesh raises :class:`LoadError` naming the file on every rank (the same message);
    a world size other than the export's raises :class:`MeshMismatchError`.  If an export
    into the same directory crashed mid-swap, the complete export beside it is loaded
    with a warning.  docs/reliability.md lists the faults and the errors.  ``batch`` and
    ``timeout`` (seconds, default 600) are as in :func:`auto_parallel`."""
    return load_module(directory, batch=batch, timeout=timeout)


__all__ = [
    "AutoparError", "AutoparWarning", "CallMismatchError", "CaptureError", "CompileFallbackWarning", "ExportError", "LazyParallel", "LoadError", "MeshMismatchError",
    "MeshSpec", "ParallelModule", "Partial", "Plan", "PlanError", "Replicate", "Shard", "auto_parallel",
    "load", "load_checkpoint", "plan", "save_checkpoint", "verify",
]
