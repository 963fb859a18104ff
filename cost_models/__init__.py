"""Cost models: device mesh description, compute roofline, collectives and memory.

Installed as ``autopar.cost_models``; imports nothing else from ``autopar`` so every other
package can depend on it without cycles. ``calibrate`` imports torch lazily.
"""

from .calibrate import Calibration, calibrate, fit_alpha_beta, measure_cluster
from .collective_costs import (
    CollectiveKind,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    blocking_time,
    blocking_times,
    broadcast_time,
    collective_time,
    collective_times,
    drift_after,
    reduce_scatter_time,
    send_recv_time,
)
from .compute import compute_time, kernel_rate, matmul_flops, optimizer_step_time
from .link import LinkSpec
from .memory import (
    MemoryBreakdown,
    OptimizerKind,
    format_bytes,
    optimizer_state_bytes,
    peak_live_bytes,
)
from .mesh import MeshSpec
from .presets import PRESET_NAMES
from .refine import Refinement, refine

__all__ = [
    "PRESET_NAMES",
    "Calibration",
    "CollectiveKind",
    "LinkSpec",
    "MemoryBreakdown",
    "MeshSpec",
    "OptimizerKind",
    "Refinement",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "blocking_time",
    "blocking_times",
    "broadcast_time",
    "calibrate",
    "collective_time",
    "collective_times",
    "compute_time",
    "drift_after",
    "kernel_rate",
    "fit_alpha_beta",
    "format_bytes",
    "matmul_flops",
    "measure_cluster",
    "optimizer_step_time",
    "optimizer_state_bytes",
    "peak_live_bytes",
    "reduce_scatter_time",
    "refine",
    "send_recv_time",
]
