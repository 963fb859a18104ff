"""What keeping state in host memory costs and saves (decision ``offload``,
:class:`~autopar.plans.kinds.Offload`), for one pipeline stage under one config.

Per layer, :class:`~autopar.search.stages.zero_price.ZeroPrice` says what a device holds
(``params``, ``grads``, ``optimizer``) and what the optimizer updates.  A rank *owns*
the parameters its optimizer steps: a ZeRO parameter's shard, any other whole.

* ``optimizer``: the optimizer state leaves the device; the host holds it with a copy of
  the owned parameters (the ones the optimizer steps) and of their gradients.  Each
  step the owned gradients go down and the updated parameters up, over the host link
  (``MeshSpec.host_bandwidth``), and the optimizer streams its state at the host's
  memory bandwidth (``MeshSpec.host_mem_bandwidth``) instead of the device's.  Nothing
  overlaps them (the runtime copies at the step's edges), so they are priced exposed.
* ``params`` (ZeRO-3): the shards, their gradients and the optimizer state all leave
  the device; every micro-batch copies each layer's shard up before its forward gather
  and again before its backward re-gather, and its reduce-scattered gradient down.

The host's memory is a budget of its own (``MeshSpec.host_memory``): a stage that
needs more is priced infinite (the search then keeps other configs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.cost_models import MeshSpec, optimizer_state_bytes, optimizer_step_time
from autopar.plans.decisions import PlanOptions, prices, zero_axes
from autopar.plans.kinds import Offload
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.zero_price import ZeroPrice, on_zero


@dataclass(frozen=True)
class OffloadPrice:
    """One stage's offload: device bytes it frees, host bytes it takes, and its time."""

    params: float = 0.0
    """Parameter bytes that live on the host instead of the device."""
    optimizer: float = 0.0
    """Optimizer-state bytes that live on the host instead of the device."""
    host: float = 0.0
    """Host bytes per device."""
    step: float = 0.0
    """Seconds per step, exposed: the copies at the step's edges and the host's
    optimizer step, less the device's optimizer step it replaces."""
    per_micro: float = 0.0
    """Seconds per micro-batch (``params``: the shards up twice, the gradients down)."""
    host_opt: float = 0.0
    """The host's optimizer step (inside ``step``)."""


def kinds(opts: PlanOptions, zero_stage: int, mesh: MeshSpec) -> list[str]:
    """The offload levels a config with ``zero_stage`` prices: none unless asked;
    under ``"auto"`` also ``optimizer`` (and ``params`` under ZeRO-3) where the mesh
    says how much host memory there is; a forced level as asked (``params`` only with
    ZeRO-3: no level for other stages)."""
    asked = opts.offload
    if asked is None or asked == Offload.NONE.value:
        return [Offload.NONE.value]
    if asked == "auto":
        if mesh.host_memory is None:
            return [Offload.NONE.value]
        return [Offload.NONE.value, Offload.OPTIMIZER.value] + \
            ([Offload.PARAMS.value] if zero_stage == 3 else [])
    if asked == Offload.PARAMS.value and zero_stage != 3:
        return []
    return [asked]


@prices("offload")
def offload_price(layers: list[LayerStat], zp: list[ZeroPrice], level: str, zero_stage: int,
                  zero_axis, mesh: MeshSpec, optimizer: str, micro_batches: int) -> OffloadPrice:
    """The stage's :class:`OffloadPrice` under ``level`` (see the module docstring)."""
    if level == Offload.NONE.value:
        return OffloadPrice()
    zax = zero_axes(zero_axis)
    d = math.prod(mesh.shape[a] for a in zax) if zax else 1
    owned = 0.0  # bytes of the parameters this rank's optimizer steps
    for st in layers:
        for p in st.params:
            owned += p.bytes / d if on_zero(p.replicated, zero_stage, zax) else p.bytes
    state = sum(z.optimizer for z in zp)
    link = mesh.host_bandwidth or mesh.mem_bandwidth
    # the host's step: at its memory bandwidth; on a CPU (no host figure) at the rate the
    # device's own optimizer step runs, calibrated or not
    host_mesh = dataclasses.replace(mesh, optimizer_bandwidth=mesh.host_mem_bandwidth or mesh.optimizer_bandwidth
                                    or mesh.mem_bandwidth)
    host_opt = optimizer_step_time(host_mesh, owned, optimizer_state_bytes(owned, optimizer))
    device_opt = sum(z.opt_step for z in zp)
    if level == Offload.OPTIMIZER.value:
        # gradients down, updated parameters up: the owned bytes each way
        return OffloadPrice(optimizer=state, host=state + 2.0 * owned,
                            step=2.0 * owned / link + host_opt - device_opt, host_opt=host_opt)
    # params (ZeRO-3): the shards and the state leave the device; their gradients go
    # down as they are reduce-scattered (still counted on the device: they pass there)
    if any(on_zero(p.replicated, zero_stage, zax) and set(p.replicated) - set(zax)
           for st in layers for p in st.params):
        # shards also reduced over other axes (HSDP): the runtime does not offload those
        return OffloadPrice(step=math.inf)
    shards = sum(z.params for z in zp)
    grads = sum(z.grads for z in zp)
    per_micro = (2.0 * shards + grads) / link
    return OffloadPrice(params=shards, optimizer=state, host=shards + grads + state,
                        step=host_opt - device_opt, per_micro=per_micro, host_opt=host_opt)


__all__ = ["OffloadPrice", "kinds", "offload_price"]
