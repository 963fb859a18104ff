"""Dynamic loss scaling for ``precision="fp16-mixed"`` whose ranks agree on every skip.

fp16 has 5 exponent bits: a backward in fp16 underflows small gradients to zero unless
the loss is multiplied by a large factor first, and a factor too large overflows to
inf.  ``torch.amp.GradScaler`` handles both (scale the loss, unscale the gradients,
skip the optimizer step and halve the scale when any gradient is not finite).  Across
ranks that check must agree: a rank sees only its shards (tensor parallelism, ZeRO,
its pipeline stage), so one rank's inf would make it skip while the others step, and
the replicas drift apart for good.  :class:`GradScaler` is ``torch.amp.GradScaler``
with one change: after unscaling this rank's local gradients it takes the max of the
found-inf flag over every rank (one 4-byte all-reduce per optimizer step, as FSDP's
``ShardedGradScaler`` does), so every rank skips or steps together and the scales stay
equal.  It unscales each DTensor gradient's local tensor in place (the DTensor is a view
of it), which is also what keeps it off DTensor's op dispatch.

``ParallelModule.grad_scaler()`` makes one and registers it, so ``train_step`` seeds
every micro-batch's backward with the current scale (its backward runs inside, where
the caller cannot scale the loss); in a plain loop ``scaler.scale(loss).backward()``
does the same.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from autopar.runtime.tls import issue


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose found-inf check is agreed over all ranks (see the
    module docstring).  ``group``: the ranks that must agree (default: all)."""

    def __init__(self, device: str = "cpu", group: dist.ProcessGroup | None = None,
                 **kwargs) -> None:
        """Same arguments as ``torch.amp.GradScaler``, plus ``group``."""
        super().__init__(device, **kwargs)
        self._group = group

    def scale_factor(self) -> float:
        """The factor a backward seed is multiplied by now (1.0 when disabled).  Like
        :meth:`scale`, it starts the scale's bookkeeping, which ``unscale_`` and
        ``update`` need (``train_step`` seeds with it instead of calling ``scale``)."""
        if not self.is_enabled():
            return 1.0
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        return float(self.get_scale())

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = \
            defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    local = g.to_local() if hasattr(g, "to_local") else g
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grads[local.device][local.dtype].append(local)
            # this rank's verdict per device; a rank without gradients still takes part
            devices = list(grads) or [found_inf.device]
            flags = {d: found_inf.to(d).clone() for d in devices}
            for d, per_dtype in grads.items():
                for ts in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(ts, flags[d], inv_scale.to(d))
            # one all-reduce, the same on every rank: inf anywhere is inf everywhere
            mine = torch.stack([f.to(found_inf.device).reshape(()) for f in flags.values()]).amax()
            mine = mine.reshape(1).to(torch.float32)
            if dist.is_initialized():
                issue(dist.all_reduce, mine, op=dist.ReduceOp.MAX, group=self._group)
            for d in flags:
                flags[d].copy_(mine.reshape(()).to(d))
        return flags


__all__ = ["GradScaler"]
