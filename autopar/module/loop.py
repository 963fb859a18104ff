"""Training-loop habits of a ParallelModule: ``train()``/``eval()``, data-parallel
coordinates for ``DistributedSampler``, clipping over every pipeline stage, the dropout
generator, the first call's check, the loss scale, and moving weights to the rank's
device (:class:`LoopHabits`, which :class:`autopar.module.parallel.ParallelModule`
holds and delegates to)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.module.parts import Parts
from autopar.passes.train_mode import set_train_mode
from autopar.runtime import rng
from autopar.runtime.call_check import CallCheck
from autopar.runtime.inputs import data_parallel_coords
from autopar.runtime.scaler import GradScaler
from autopar.runtime.trace import trace


def move_to_device(module: nn.Module, device: torch.device) -> None:
    """Move parameters and buffers to ``device`` in place, except meta stand-ins (other
    pipeline stages' weights on a loaded module, which this rank drops)."""
    with torch.no_grad():
        for m in module.modules():
            for store in (m._parameters, m._buffers):
                for k, t in store.items():
                    if t is not None and not t.is_meta and t.device != device:
                        if isinstance(t, nn.Parameter):
                            t.data = t.data.to(device)
                        else:
                            store[k] = t.to(device)
            if isinstance(m, torch.fx.GraphModule):  # tensor constants export lifted
                for n in m.graph.nodes:
                    if n.op != "get_attr":
                        continue
                    *path, leaf = n.target.split(".")
                    owner = m.get_submodule(".".join(path)) if path else m
                    t = owner.__dict__.get(leaf)
                    if isinstance(t, torch.Tensor) and not t.is_meta and t.device != device:
                        setattr(owner, leaf, t.to(device))


class LoopHabits:
    """The loop habits of one module, read from its :class:`~autopar.module.parts.Parts`
    (see the module docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.rng: torch.Generator | None = None
        """The module's own dropout generator (:meth:`manual_seed`); until then dropout
        draws from torch's default generator of this rank's device
        (:mod:`autopar.runtime.rng`)."""
        self.call_check: CallCheck | None = None
        self.has_dropout = False
        self.scaler = None

    def generator(self) -> torch.Generator:
        """The generator this call's dropouts draw from."""
        return self.rng if self.rng is not None else rng.default_generator(self.parts.mesh.device)

    def manual_seed(self, seed: int) -> None:
        """The module's own dropout generator, seeded with ``seed``
        (ParallelModule.manual_seed)."""
        self.rng = torch.Generator(device=self.parts.mesh.device)
        self.rng.manual_seed(seed)

    def start_call_check(self) -> None:
        """The first call's agreement check (:mod:`autopar.runtime.call_check`)."""
        binder = self.parts.binder
        local = binder.mode.value == "local"
        self.call_check = CallCheck(key=self.data_parallel_rank if local else 0, local=local,
                                    names=list(binder.names), device=self.parts.mesh.device)
        # a dropout that draws (p > 0): the ranks' generators must then agree
        self.has_dropout = any(n.target is rng.sharded_dropout and n.args[1] != 0.0
                               for g in self.graph_modules() for n in g.graph.nodes)

    def graph_modules(self) -> list[torch.fx.GraphModule]:
        """Every generated graph this rank runs: the module's, and under a pipeline
        every chunk's stage graph (interleaved: several)."""
        p = self.parts
        graphs = [m for m in p.inner.modules() if isinstance(m, torch.fx.GraphModule)]
        graphs += p.routes.graphs()
        if p.runner is not None:
            graphs += [m for ch in p.runner.chunks for m in ch.module.modules()
                       if isinstance(m, torch.fx.GraphModule)]
        return graphs

    def flatten_checked(self, args: tuple, kwargs: dict, generator: torch.Generator,
                        training: bool) -> list:
        """The binder's flat inputs; on the first call the ranks also check that they
        passed what the plan needs equal (:mod:`autopar.runtime.call_check`), and a rank
        whose call is refused takes the others down with it rather than leave them waiting."""
        check, binder, device = self.call_check, self.parts.binder, self.parts.mesh.device
        if check is None or not check.due(training, generator):
            return binder.flatten(args, kwargs, device)
        dropout = training and self.has_dropout
        done = []

        def given(flat: list) -> None:
            done.append(True)
            check(flat, generator, dropout)

        try:
            return binder.flatten(args, kwargs, device, given=given)
        except Exception as e:
            if not done:  # refused before the check: tell the other ranks, then raise
                check(None, generator, dropout, failure=e)
            raise

    def trace(self, path, record_shapes: bool = False):
        """:func:`autopar.runtime.trace.trace` on this rank's device (ParallelModule.trace)."""
        return trace(path, self.parts.mesh.device, record_shapes)

    def set_train_mode(self, mode: bool) -> None:
        """The generated graphs' dropout and batch-norm calls take the mode as an
        argument: set it to ``mode``."""
        set_train_mode(self.graph_modules(), mode)

    def _dp_coords(self) -> tuple[int, int]:
        p = self.parts
        return data_parallel_coords(p.binder.dp_axes, p.plan.mesh.shape, p.coord())

    @property
    def data_parallel_size(self) -> int:
        """How many different parts the global batch is split into."""
        return self._dp_coords()[1]

    @property
    def data_parallel_rank(self) -> int:
        """Which part of the global batch this rank holds."""
        return self._dp_coords()[0]

    def grad_scaler(self, **kwargs):
        """A new :class:`autopar.runtime.scaler.GradScaler` on the module's device,
        kept for :meth:`loss_scale` (ParallelModule.grad_scaler)."""
        device = self.parts.mesh.device.type if self.parts.mesh is not None else "cpu"
        self.scaler = GradScaler(device, **kwargs)
        return self.scaler

    def loss_scale(self) -> float:
        """The scale each backward is seeded with: the grad scaler's, else 1."""
        return self.scaler.scale_factor() if self.scaler is not None else 1.0

    def clip_grad_norm_(self, params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``params`` by their global norm over every rank and
        pipeline stage and return that norm (ParallelModule.clip_grad_norm_)."""
        grads = [p.grad for p in params if p.grad is not None]
        m = self.parts.mesh
        if grads:
            total = torch.nn.utils.get_total_norm(grads, norm_type)
            total = total.full_tensor() if isinstance(total, DTensor) else total
        else:
            total = torch.zeros((), device=m.device)
        if m is not None and m.stages > 1:
            pp = m.device_mesh.get_group(0)
            if norm_type == float("inf"):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp)
            else:
                total = total.pow(norm_type)
                dist.all_reduce(total, group=pp)
                total = total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return total


__all__ = ["LoopHabits", "move_to_device"]
