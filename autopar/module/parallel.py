"""The module a plan runs as: :class:`ParallelModule`, this rank's part of a planned model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.grad_flow import named_loss
from autopar.module.loop import LoopMixin, move_to_device
from autopar.module.state import StateMixin, TensorInfo
from autopar.plan.data import Plan
from autopar.plan.placement import is_replicate, parse_placements
from autopar.runtime import rng
from autopar.runtime.inputs import BatchMode, InputBinder, data_parallel_axes, passthrough_inputs
from autopar.runtime.mesh import activate

# attribute names of ParallelModule itself: a model's top-level submodule or parameter
# of the same name could not be registered under its own name
_RESERVED = frozenset({"inner", "plan", "aliases", "state_keys", "rank", "runner", "zero", "rng",
                       "grad_sync", "lowered_graph", "code", "binder", "info", "training"})


class ParallelModule(LoopMixin, StateMixin, nn.Module):
    r"""This rank's part of a planned model.

    Under a process group its parameters are ``nn.Parameter``\ s holding DTensors on
    the plan's ``DeviceMesh`` with the plan's placements, under the original model's
    names (tied weights once), so ``torch.optim``, ``clip_grad_norm_``,
    ``torch.distributed.checkpoint`` and ``state_dict()`` work unchanged; the generated
    graph (``inner``, not a submodule) computes on their local shards.  ``forward``
    takes the same inputs as the original model (positional or ``model(**batch)``) and
    returns the same output type, replicated on every rank.  Without a process group the
    module is *planning only*: ``plan``, ``code`` and ``export`` work; calling it raises.
    """

    def __init__(self, inner: nn.Module, plan: Plan, aliases: dict[str, list[str]],
                 in_spec, out_spec, state_keys: list[str], full_state: Mapping[str, torch.Tensor] | None,
                 runtime: bool, info: TensorInfo | None = None, binder: InputBinder | None = None,
                 batch: BatchMode | str = BatchMode.GLOBAL,
                 extra: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: users see DTensors only
        self.plan = plan
        self.aliases = aliases
        self.info = info or TensorInfo()
        self._in_spec, self._out_spec = in_spec, out_spec
        self.binder = binder or InputBinder(in_spec)
        self.binder.mode = BatchMode(batch)
        self.binder.dp_axes = data_parallel_axes(plan)
        # the flat inputs the lowered graph takes as this rank's rows (passes/lower.py
        # skips their slice; placeholders keep their names through export and load)
        keep = passthrough_inputs(plan)
        graph = getattr(inner, "graph", None)
        self.binder.passthrough = frozenset(
            i for i, n in enumerate(x for x in graph.nodes if x.op == "placeholder")
            if n.name in keep) if graph is not None else frozenset()
        self.state_keys = state_keys
        self._target_of = {n: t for t, names in aliases.items() for n in names}
        self._extra: dict[str, torch.Tensor] = {}
        self._entry: dict = {}
        self._dparams = None
        self._placements = {t: parse_placements(p) for t, p in plan.params().items()}
        self._mesh_rt = None
        self._call_check = None
        self.rank = 0
        self.runner = None
        self._param_nodes = {n.param: n for n in plan.nodes.values() if n.param}
        d = plan.decisions
        # graph target -> pipeline stage owning it (everything on stage 0 without a pipeline)
        self._owner = {n.param: d.rank_of(n.layer) if d.pipeline_stages > 1 else 0
                       for n in plan.nodes.values() if n.kind in ("param", "buffer") and n.param}
        if runtime:
            from autopar.runtime.mesh import init_plan_mesh
            self._mesh_rt = init_plan_mesh(plan)
            self.rank = dist.get_rank()
        # planning-only: keep the whole weights so export() can write every rank's shards
        self._full_state = dict(full_state) if (full_state is not None and not runtime) else None
        # the lowered graph before the runtime rewrites below (ZeRO-3 gathers, recompute,
        # stage split): export() writes it and load() re-applies them from the plan
        from autopar.module.export import snapshot
        self.lowered_graph = snapshot(inner.graph) if isinstance(inner, torch.fx.GraphModule) else None
        self.zero = None
        if full_state is not None:
            self._load_targets(full_state, self._coord())
        if runtime:
            # one device per process (cuda:LOCAL_RANK under NCCL): weights, buffers and the
            # graph's constants move there before anything views them
            move_to_device(inner, self._mesh_rt.device)
            from autopar.passes.device import set_device
            set_device([m for m in inner.modules() if isinstance(m, torch.fx.GraphModule)],
                       self._mesh_rt.device)
            for t, p in self._targets():  # also for modules loaded from an export
                if isinstance(p, nn.Parameter) and self._frozen(t):
                    p.requires_grad_(False)
            self._start_zero()
            self._start_schedule()
            self._start_grad_sync()
            self._start_dparams(full_state if full_state is not None else extra)
            self._start_rng()
            self._start_call_check()

    # ------------------------------------------------------------ running
    def _coord(self) -> tuple[int, ...]:
        return self._mesh_rt.coord if self._mesh_rt is not None else (0,) * len(self.plan.mesh.shape)

    def _replicated_axes(self, t: str) -> tuple[int, ...]:
        pl = self._placements[t]
        return tuple(a for a, x in enumerate(pl) if is_replicate(x) and self.plan.mesh.shape[a] > 1)

    def _start_zero(self) -> None:
        """Put replicated parameters under ZeRO when the plan says so."""
        from autopar.runtime.zero import Zero
        d = self.plan.decisions
        z = tuple(a for a in d.zero_axes if self.plan.mesh.shape[a] > 1)
        if not z:
            return
        params = []
        for t, p in self._targets():
            if not self._mine(t):
                continue
            # a parameter replicated on every ZeRO axis (one sharded on some of them by
            # the plan keeps its placement and its gradient sync)
            if t in self._placements and isinstance(p, nn.Parameter) and p.requires_grad \
                    and set(z) <= set(self._replicated_axes(t)):
                params.append((t, tuple(a for a in self._replicated_axes(t) if a not in z)))
        layers = {n.param: n.layer for n in self.plan.nodes.values() if n.param and n.layer}
        self.zero = Zero.install(self.inner, params, d.zero_stage, z, layers, frozenset(d.zero_kept))

    def _mine(self, t: str) -> bool:
        """True when this rank's pipeline stage holds target ``t``."""
        stage = self._mesh_rt.stage if self._mesh_rt is not None else 0
        return self._owner.get(t, 0) == stage

    def _start_schedule(self) -> None:
        """Recompute the planned layers; split pipeline stages; drop other stages' weights."""
        d = self.plan.decisions
        from autopar.plan.schedules import conflict
        why = conflict(d.schedule, bool(d.recompute), d.zero_stage)
        if why:  # a plan file edited or made elsewhere: the search never makes one
            from autopar.errors import PlanError
            raise PlanError(f"this plan runs schedule {d.schedule!r} with {why}; plan it again")
        if d.zero_reduce_once and (d.zero_stage != 3 or d.pipeline_stages > 1):
            # the runner turns sync on at a rank's last backward only: other pipeline
            # chunks' sums would never be reduced
            from autopar.errors import PlanError
            raise PlanError("this plan reduces ZeRO-3 gradients once a step (zero_reduce_once) with "
                            f"zero_stage={d.zero_stage} and {d.pipeline_stages} pipeline stages: it "
                            "needs zero_stage=3 and no pipeline; plan it again")
        if d.recompute:
            from autopar.passes.recompute import recompute
            recompute(self.inner, set(d.recompute))
        if d.pipeline_stages == 1 and d.micro_batches == 1:
            return
        from autopar.passes.split_stages import split_stages
        from autopar.runtime.pipeline import PipelineRunner
        self._keep_loss_only()
        # this rank's graph; under the interleaved schedule its chunks s, s + p, ..
        graphs = split_stages(self.inner, self.plan)
        mine = graphs[self._mesh_rt.stage::max(1, d.pipeline_stages)]
        for t in list(self.aliases):
            if not self._mine(t):
                owner, leaf = self._owner_of(t)
                if hasattr(owner, leaf):
                    delattr(owner, leaf)
        self.runner = PipelineRunner(mine, d.schedule, d.micro_batches, _Switches(self))

    def _keep_loss_only(self) -> None:
        """Micro-batched plans run ``train_step``, which returns the loss alone: keep only
        the loss among the graph's outputs (a Hugging Face output's ``loss``), so the
        schedule has one value to seed backward with and logits are not gathered."""
        g = self.inner.graph
        out = next(n for n in g.nodes if n.op == "output")
        flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        if len(flat) == 1:
            return
        idx = named_loss(len(flat), self._out_spec)
        if idx is None:
            from autopar.errors import PlanError
            raise PlanError(f"this plan runs {self.plan.decisions.micro_batches} micro-batches: "
                            f"the model must return its loss (a scalar tensor, or an output with "
                            f"a 'loss' field), but it returns {len(flat)} values")
        out.args = ((flat[idx],),)
        g.eliminate_dead_code()
        self.inner.recompile()

    def _owner_of(self, t: str) -> tuple[nn.Module, str]:
        *path, leaf = t.split(".")
        return (self.inner.get_submodule(".".join(path)) if path else self.inner), leaf

    def _start_grad_sync(self) -> None:
        from autopar.runtime.grad_sync import GradSync
        params = []
        zt = self.zero.targets() if self.zero is not None else set()
        for t, p in self._targets():
            if not self._mine(t):
                continue
            if t in zt:
                zp = self.zero._by_target[t]
                if self.zero.stage == 3 and zp.other_axes:
                    # stage 3: the shard's gradient is still Partial on the other axes
                    params.append((t, zp.shard, zp.other_axes))
                continue
            if t in self._placements and isinstance(p, nn.Parameter) and p.requires_grad:
                params.append((t, p, self._replicated_axes(t)))
        self.grad_sync = GradSync(params, self.plan.decisions.grad_buckets,
                                  keep=self.plan.decisions.grad_buffers_kept)

    def _frozen(self, t: str) -> bool:
        return all(n in self.info.frozen for n in self.aliases.get(t, [t]))

    def _start_dparams(self, full_state: Mapping[str, torch.Tensor] | None) -> None:
        """Register this stage's parameters as DTensors (and its buffers) under the
        original names; see :mod:`autopar.runtime.dparams`."""
        from torch.distributed.tensor import Replicate

        from autopar.runtime import local_step
        from autopar.runtime.dparams import DParams, flat_layout, register_tree
        mesh = self._mesh_rt.param_mesh
        zt = self.zero.targets() if self.zero is not None else set()
        entries = []
        for t, p in self._targets():
            if not self._mine(t):
                continue
            names = self.aliases[t]
            if t in zt:
                zp = self.zero._by_target[t]
                pl, shape = flat_layout(self._placements[t], self.zero.axes, zp.shard.numel(),
                                        self.plan.mesh.shape)
                e = DParams.make(t, zp.shard, mesh, pl, shape, True,
                                 hook_on=zp.full if zp.full is not None else zp.shard)
            elif t in self._placements and isinstance(p, nn.Parameter):
                e = DParams.make(t, p, mesh, self._placements[t], tuple(self._param_nodes[t].shape[0]),
                                 p.requires_grad)
            else:
                for n in names:
                    if p is not None:
                        register_tree(self, n, p, buffer=True, reserved=_RESERVED,
                                      persistent=n not in self.info.nonpersistent)
                continue
            if t not in zt and all(isinstance(q, Replicate) for q in e.placements):
                local_step.mark(e.param, e.local)  # replicated: steps run on the local tensor
            entries.append(e)
            self._entry[t] = e
            for n in names:  # tied weights: one Parameter under every name
                register_tree(self, n, e.param, reserved=_RESERVED)
        # tensors the forward never reads: kept whole on every rank (replicated)
        from autopar.runtime.dparams import as_dtensor
        for n in sorted(self.info.unused):
            if full_state is None or n not in full_state:
                continue
            x = full_state[n].detach().clone()
            if n in self.info.buffers:
                register_tree(self, n, x, buffer=True, reserved=_RESERVED,
                              persistent=n not in self.info.nonpersistent)
                self._extra[n] = x
            else:
                dt = nn.Parameter(as_dtensor(x, mesh, (Replicate(),) * mesh.ndim, x.shape),
                                  requires_grad=n not in self.info.frozen)
                register_tree(self, n, dt, reserved=_RESERVED)
                local_step.mark(dt, dt._local_tensor)
                self._extra[n] = dt
        self._dparams = DParams(mesh, entries, getattr(self, "grad_sync", None))

    def _targets(self) -> list[tuple[str, torch.Tensor | None]]:
        """(graph target, tensor attribute) for every parameter and buffer; ``None`` for
        a stage-3 ZeRO parameter, which exists only as a shard."""
        out: list[tuple[str, torch.Tensor | None]] = []
        for t in self.aliases:
            try:
                out.append((t, self.inner.get_parameter(t)))
            except AttributeError:
                try:
                    out.append((t, self.inner.get_buffer(t)))
                except AttributeError:
                    out.append((t, None))
        return out

    def _bind(self, args: tuple, kwargs: dict) -> list:
        if self._mesh_rt is None:
            raise RuntimeError("this ParallelModule is planning-only (no process group); "
                               "launch under torchrun to run it, or export() it")
        # this module's groups, whatever module ran last (runtime.mesh.activate)
        activate(self._mesh_rt)
        generator = self._generator()
        flat = self._flatten_checked(args, kwargs, generator)
        rng.use(generator)
        if self._dparams is not None:
            self._dparams.before_forward()
        if self.zero is not None:
            self.zero.refresh()
        return flat

    def _outputs(self, out):
        return pytree.tree_unflatten(list(out), self._out_spec) if self._out_spec is not None else out

    def forward(self, *args, **kwargs):
        """Run this rank's part: same inputs and outputs as the original model."""
        flat = self._bind(args, kwargs)
        if self.runner is not None:
            raise RuntimeError(
                f"this plan runs {self.plan.decisions.micro_batches} micro-batches over "
                f"{self.plan.decisions.pipeline_stages} pipeline stage(s): forward and backward are "
                "interleaved by the schedule, so call loss = module.train_step(*inputs) "
                "(it runs forward and backward) and then optimizer.step()")
        if self.zero is not None and self.zero.stage == 3:
            from autopar.runtime.zero import free_gathered_params
            with free_gathered_params():
                return self._outputs(self.grad_sync.watch(self.inner(*flat), self._dparams))
        return self._outputs(self.grad_sync.watch(self.inner(*flat), self._dparams))

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch (all micro-batches, every pipeline
        stage); gradients are left in ``.grad`` (summed into any already there).
        Returns the loss (detached), the same on every rank; for a model whose output
        is not a tensor (e.g. a Hugging Face ``ModelOutput``), its ``loss``.  With a
        :meth:`grad_scaler`, every backward is seeded with its scale (the loss returned
        is not scaled)."""
        scale = self._loss_scale()  # fp16-mixed: grad_scaler()'s current scale
        if self.runner is None:
            out = self(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else out["loss"]
            (loss * scale if scale != 1.0 else loss).backward()
            return loss.detach()
        self.runner.loss_scale = scale
        flat = self._bind(args, kwargs)
        self.grad_sync.restart()  # the step's backwards add to what is there
        if self.zero is not None and self.zero.stage == 3:
            from autopar.runtime.zero import free_gathered_params
            with free_gathered_params():
                return self.runner.step(flat)
        return self.runner.step(flat)

    @property
    def code(self) -> str:
        """The generated per-rank forward code, collectives included."""
        return self.inner.code

    def export(self, directory: str | Path) -> Path:
        """Write code, plan and weights so :func:`autopar.load` runs it without re-planning."""
        from autopar.module.export import export_module
        return export_module(self, Path(directory))

    def shutdown(self) -> None:
        """Destroy the process group (call once at the end of a torchrun script).

        The groups are destroyed here, not at interpreter exit: their worker threads
        end before this returns (:func:`autopar.runtime.mesh.release_groups` says why)."""
        from autopar.runtime.mesh import release_groups, reset

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self._mesh_rt is not None:
            release_groups(self._mesh_rt)
        reset()


class _Switches:
    """Turns gradient synchronisation (plain and ZeRO) on and off together; the
    pipeline runner keeps it off except for a stage's last backward."""

    def __init__(self, pm: ParallelModule) -> None:
        self._pm = pm

    @property
    def enabled(self) -> bool:
        """Whether gradient hooks reduce."""
        return self._pm.grad_sync.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._pm.grad_sync.enabled = on
        if self._pm.zero is not None:
            self._pm.zero.enabled = on
            if self._pm.plan.decisions.zero_reduce_once:
                # ZeRO-3 reduce-scatters in the backward where sync is on (the last)
                from autopar.runtime.zero3 import defer
                defer(self._pm.zero.group_keys, not on)

    def flush(self) -> None:
        """Reduce every gradient now (plain buckets, then ZeRO's), then point the
        DTensor parameters' ``.grad`` at the results (what the hooks would have done)."""
        self._pm.grad_sync.flush()
        if self._pm.zero is not None:
            self._pm.zero.flush()
        if self._pm._dparams is not None:
            self._pm._dparams.bridge()


__all__ = ["ParallelModule"]
