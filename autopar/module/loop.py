"""Training-loop habits of a ParallelModule: ``train()``/``eval()``, data-parallel
coordinates for ``DistributedSampler``, clipping over every pipeline stage, the dropout
generator, and moving weights to the rank's device (a mixin of
:class:`autopar.module.parallel.ParallelModule`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime import rng
from autopar.runtime.inputs import data_parallel_coords


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


class LoopMixin:
    """See the module docstring; expects ParallelModule's attributes."""

    def _start_rng(self) -> None:
        """Dropout draws from torch's default generator of this rank's device until
        :meth:`manual_seed` gives the module one of its own: see :mod:`autopar.runtime.rng`.
        The first call checks that the ranks' generators agree
        (:mod:`autopar.runtime.call_check`)."""
        self.rng = None

    def _generator(self) -> torch.Generator:
        """The generator this call's dropouts draw from."""
        return self.rng if self.rng is not None else rng.default_generator(self._mesh_rt.device)

    def manual_seed(self, seed: int) -> None:
        """Give the module's dropouts a generator of their own, seeded with ``seed`` (call
        with the same seed on every rank): they then draw what one process would draw
        after ``torch.manual_seed(seed)``, and no longer follow torch's generator."""
        self.rng = torch.Generator(device=self._mesh_rt.device)
        self.rng.manual_seed(seed)

    def _start_call_check(self) -> None:
        """The first call's agreement check (:mod:`autopar.runtime.call_check`)."""
        from autopar.runtime.call_check import CallCheck
        local = self.binder.mode.value == "local"
        self._call_check = CallCheck(key=self.data_parallel_rank if local else 0, local=local,
                                     names=list(self.binder.names), device=self._mesh_rt.device)
        # a dropout that draws (p > 0): the ranks' generators must then agree
        self._has_dropout = any(n.target is rng.sharded_dropout and n.args[1] != 0.0
                                for g in self._graph_modules() for n in g.graph.nodes)

    def _graph_modules(self) -> list[torch.fx.GraphModule]:
        """Every generated graph this rank runs: the module's, and under a pipeline
        every chunk's stage graph (interleaved: several)."""
        graphs = [m for m in self.inner.modules() if isinstance(m, torch.fx.GraphModule)]
        graphs += self.routes.graphs()
        if self.runner is not None:
            graphs += [m for ch in self.runner.chunks for m in ch.module.modules()
                       if isinstance(m, torch.fx.GraphModule)]
        return graphs

    def _flatten_checked(self, args: tuple, kwargs: dict, generator: torch.Generator) -> list:
        """The binder's flat inputs; on the first call the ranks also check that they
        passed what the plan needs equal (:mod:`autopar.runtime.call_check`), and a rank
        whose call is refused takes the others down with it rather than leave them waiting."""
        check = self._call_check
        if check is None or not check.due(self.training, generator):
            return self.binder.flatten(args, kwargs, self._mesh_rt.device)
        dropout = self.training and self._has_dropout
        done = []

        def given(flat: list) -> None:
            done.append(True)
            check(flat, generator, dropout)

        try:
            return self.binder.flatten(args, kwargs, self._mesh_rt.device, given=given)
        except Exception as e:
            if not done:  # refused before the check: tell the other ranks, then raise
                check(None, generator, dropout, failure=e)
            raise

    def trace(self, path, record_shapes: bool = False):
        """Record the real steps run inside ``with pm.trace("step.json") as t:`` (call
        ``t.step()`` after each) as a Chrome trace per rank, ``step.rank<r>.json``, to
        open beside the predicted one (``autopar plan --trace``); see
        :mod:`autopar.runtime.trace`."""
        from autopar.runtime.trace import trace

        return trace(path, self._mesh_rt.device, record_shapes)

    # ------------------------------------------------------------ training-loop habits
    def train(self, mode: bool = True):
        """Switch dropout and batch norm between training and evaluation, as
        ``nn.Module.train`` does for the original model: the generated graphs' dropout
        and batch-norm calls take the mode as an argument, which is set here."""
        super().train(mode)
        from autopar.passes.train_mode import set_train_mode
        set_train_mode(self._graph_modules(), mode)
        return self

    @property
    def data_parallel_size(self) -> int:
        """How many different parts the global batch is split into: give
        ``DistributedSampler(num_replicas=pm.data_parallel_size, ...)``."""
        return data_parallel_coords(self.binder.dp_axes, self.plan.mesh.shape, self._coord())[1]

    @property
    def data_parallel_rank(self) -> int:
        """Which part of the global batch this rank holds (``DistributedSampler``'s
        ``rank``); tensor-parallel peers and pipeline stages share it."""
        return data_parallel_coords(self.binder.dp_axes, self.plan.mesh.shape, self._coord())[0]

    def grad_scaler(self, **kwargs):
        """A :class:`autopar.runtime.scaler.GradScaler` for this module (``torch.amp.
        GradScaler``'s arguments: ``init_scale``, ``growth_interval``, ...), on its
        device, whose ranks agree on every skipped step; :meth:`train_step` then seeds
        each backward with its scale.  For ``precision="fp16-mixed"``: ::

            scaler = pm.grad_scaler()
            loss = pm.train_step(x, y)       # or scaler.scale(pm(x, y)).backward()
            scaler.unscale_(opt)             # before clipping
            pm.clip_grad_norm_(1.0)
            scaler.step(opt)                 # skipped on every rank if any gradient is inf
            scaler.update()
        """
        from autopar.runtime.scaler import GradScaler

        device = self._mesh_rt.device.type if self._mesh_rt is not None else "cpu"
        self._scaler = GradScaler(device, **kwargs)
        return self._scaler

    def _loss_scale(self) -> float:
        scaler = getattr(self, "_scaler", None)
        return scaler.scale_factor() if scaler is not None else 1.0

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over every rank and pipeline stage and
        return that norm (a plain tensor, equal on every rank).  Without a pipeline this
        equals ``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)``; with one, torch's
        function sees only this stage's parameters, so use this method."""
        from torch.distributed.tensor import DTensor
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            total = torch.nn.utils.get_total_norm(grads, norm_type)
            total = total.full_tensor() if isinstance(total, DTensor) else total
        else:
            total = torch.zeros((), device=self._mesh_rt.device)
        m = self._mesh_rt
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


__all__ = ["LoopMixin", "move_to_device"]
