"""autopar: automatic parallelization planning for PyTorch.

``auto_parallel(model, example_inputs=..., mesh=MeshSpec.preset(...))`` captures the
model, searches data, tensor and ZeRO-style sharding jointly under a cost model, and
returns a module whose forward issues the collectives the plan needs.
"""

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.api import LazyParallel, ParallelModule, auto_parallel, plan
from autopar.cost_models import MeshSpec
from autopar.errors import AutoparError, CaptureError, MeshMismatchError, PlanError
from autopar.plan import Plan


def load(directory):
    """Load a module written by :meth:`ParallelModule.export` (under torchrun)."""
    from autopar.export import load_module
    return load_module(directory)


__all__ = [
    "AutoparError", "CaptureError", "LazyParallel", "MeshMismatchError", "MeshSpec",
    "ParallelModule", "Partial", "Plan", "PlanError", "Replicate", "Shard", "auto_parallel",
    "load", "plan",
]
