"""The module a plan runs as: :class:`ParallelModule`, this rank's part of a planned model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.grad_flow import named_loss
from autopar.module.apply import apply_inputs, apply_packing, apply_plan
from autopar.module.clone import clone_module
from autopar.module.export import export_module, snapshot
from autopar.module.generate import generate
from autopar.module.habits import check_loaded_state_dict, save_pretrained
from autopar.module.loop import LoopHabits
from autopar.module.parts import Part, Parts
from autopar.module.state import ModuleState, TensorInfo, checkpoint_state, load_checkpoint_state
from autopar.plans.data import Plan
from autopar.plans.placement import parse_placements
from autopar.runtime import rng
from autopar.runtime.compile_fallback import CompiledOrEager
from autopar.runtime.compiled_cache import cache_safe_views
from autopar.runtime.inputs import BatchMode, InputBinder
from autopar.runtime.mesh import activate, init_plan_mesh, release_groups, reset
from autopar.runtime.packing import pack
from autopar.runtime.zero3 import free_gathered_params


class ParallelModule(nn.Module):
    r"""This rank's part of a planned model.

    Under a process group its parameters are ``nn.Parameter``\ s holding DTensors on
    the plan's ``DeviceMesh`` with the plan's placements, under the original model's
    names (tied weights once), so ``torch.optim``, ``clip_grad_norm_``,
    ``torch.distributed.checkpoint`` and ``state_dict()`` work unchanged; the generated
    graph (``inner``, not a submodule) computes on their local shards.  ``forward``
    takes the same inputs as the original model (positional or ``model(**batch)``) and
    returns the same output type, replicated on every rank.  Without a process group the
    module is *planning only*: ``plan``, ``code`` and ``export`` work; calling it raises.

    Its state (:class:`~autopar.module.state.ModuleState`) and loop habits
    (:class:`~autopar.module.loop.LoopHabits`) are objects it holds and delegates to;
    the three share its :class:`~autopar.module.parts.Parts`.
    """

    # kept in self._parts, which the state and loop habits read too
    plan = Part("plan")
    aliases = Part("aliases")
    state_keys = Part("state_keys")
    info = Part("info")
    inner = Part("inner")  # not a submodule: users see DTensors only
    zero = Part("zero")
    runner = Part("runner")
    binder = Part("binder")
    routes = Part("routes")
    _mesh_rt = Part("mesh")
    _placements = Part("placements")
    _owner = Part("owner")
    _dparams = Part("dparams")
    _entry = Part("entry")
    _extra = Part("extra")

    def __init__(self, inner: nn.Module, plan: Plan, aliases: dict[str, list[str]],
                 in_spec, out_spec, state_keys: list[str], full_state: Mapping[str, torch.Tensor] | None,
                 runtime: bool, info: TensorInfo | None = None, binder: InputBinder | None = None,
                 batch: BatchMode | str = BatchMode.GLOBAL,
                 extra: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        d = plan.decisions
        self._parts = Parts(
            plan, aliases, state_keys, info or TensorInfo(), inner,
            placements={t: parse_placements(p) for t, p in plan.params().items()},
            # graph target -> pipeline stage owning it (everything on stage 0 without a pipeline)
            owner={n.param: d.rank_of(n.layer) if d.pipeline_stages > 1 else 0
                   for n in plan.nodes.values() if n.kind in ("param", "buffer") and n.param})
        self._state = ModuleState(self._parts)
        self._habits = LoopHabits(self._parts)
        object.__setattr__(self, "_compiled", None)  # torch.compile of inner (compile())
        self._in_spec, self._out_spec = in_spec, out_spec
        self.rank = 0
        self._param_nodes = {n.param: n for n in plan.nodes.values() if n.param}
        if runtime:
            self._mesh_rt = init_plan_mesh(plan)
            self.rank = dist.get_rank()
        apply_inputs(self, binder or InputBinder(in_spec), batch)
        self.pack_rows = apply_packing(plan)
        # planning-only: keep the whole weights so export() can write every rank's shards
        self._full_state = dict(full_state) if (full_state is not None and not runtime) else None
        # the lowered graph before the runtime rewrites below (ZeRO-3 gathers, recompute,
        # stage split): export() writes it and load() re-applies them from the plan
        self.lowered_graph = snapshot(inner.graph) if isinstance(inner, torch.fx.GraphModule) else None
        if full_state is not None:
            self._state.load_targets(full_state)
        if runtime:  # every decision applied, in one readable order (module/apply.py)
            apply_plan(self, full_state if full_state is not None else extra)

    # ------------------------------------------------------------ running
    def _bind(self, args: tuple, kwargs: dict) -> list:
        if self._mesh_rt is None:
            raise RuntimeError("this ParallelModule is planning-only (no process group); "
                               "launch under torchrun to run it, or export() it")
        # this module's groups, whatever module ran last (runtime.mesh.activate)
        activate(self._mesh_rt)
        if torch.is_grad_enabled():  # training resumed: free generate()'s whole-model copy
            self.__dict__.pop("_generation", None)
        generator = self._habits.generator()
        flat = self._habits.flatten_checked(args, kwargs, generator, self.training)
        rng.use(generator)
        if self._dparams is not None:
            self._dparams.before_forward()
        if self.zero is not None:
            if self.zero.stage < 3:  # stage 3 gathers from the shards at every use
                self._zero_writes()
            self.zero.refresh(lazy=True)  # chunks (if planned) are fetched by the graph
        return flat

    def _zero_writes(self) -> None:
        """ZeRO-1/2 gathers its shards again after an optimizer step or when a shard's
        version moved.  An in-place write to a DTensor parameter outside a step (an EMA's
        ``lerp_``, ``p.mul_`` under ``no_grad``) moves only the DTensor's own version
        (DTensor writes the local tensor below the counter): seen here, it forces the
        gather too."""
        seen = tuple(e.param._version for e in self._dparams.entries)
        if seen != getattr(self, "_param_versions", None):
            self._param_versions = seen
            self.zero.invalidate()

    def _outputs(self, out):
        if self._out_spec is None:
            return out
        n = self._out_spec.num_leaves
        if len(out) == 1 and n > 1 and (i := named_loss(n, self._out_spec)) is not None:
            # the graph keeps the loss alone (interleaved copies): the other fields None
            out = [out[0] if j == i else None for j in range(n)]
        return pytree.tree_unflatten(list(out), self._out_spec)

    def forward(self, *args, **kwargs):
        """Run this rank's part: same inputs and outputs as the original model.

        Under ``torch.compile(pm)`` (as Hugging Face's ``Trainer`` calls it) the call
        goes to :meth:`_forward_compiled`."""
        if torch.compiler.is_compiling():
            return self._forward_compiled(*args, **kwargs)
        if self.pack_rows:  # pack=True: the real tokens only (module/apply.py apply_packing)
            kwargs, packed = pack(kwargs, self.pack_rows, self.routes.pack_agree(self))
            return packed.unpack(self._call(args, kwargs))
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict):
        flat = self._bind(args, kwargs)
        if self.runner is not None:
            if self.training and torch.is_grad_enabled():
                raise RuntimeError(
                    f"this plan runs {self.plan.decisions.micro_batches} micro-batches over "
                    f"{self.plan.decisions.pipeline_stages} pipeline stage(s): forward and backward "
                    "are interleaved by the schedule, so call loss = module.train_step(*inputs) "
                    "(it runs forward and backward) and then optimizer.step(); a forward alone "
                    "(an evaluation) runs under module.eval() or torch.no_grad()")
            return self._outputs([self._scheduled(flat, evaluate=True)])
        if self.zero is not None and self.zero.stage == 3:
            with free_gathered_params():
                return self._outputs(self.grad_sync.watch(self._run(flat), self._dparams))
        return self._outputs(self.grad_sync.watch(self._run(flat), self._dparams))

    def _select_route(self, flat: list):
        """The lowering this call runs (:mod:`autopar.module.shapes`), kept for
        :meth:`forward`."""
        self._route = self.routes.select(self, flat)
        return self._route

    def _run(self, flat: list):
        """This call's graph on ``flat``: the planned one, or another shape's lowering
        (:meth:`~autopar.module.shape_template.Templates.run`)."""
        r = self._route
        if r is None or r.shape is None:
            return (self._compiled if self._compiled is not None else self.inner)(*flat)
        return self.routes.templates.run(r.shape, flat)

    @torch.compiler.disable
    def _forward_compiled(self, *args, **kwargs):
        """``torch.compile(pm)``'s call: :meth:`forward` as it runs after :meth:`compile`,
        outside dynamo.  Dynamo then compiles the generated graph alone (as
        :meth:`compile` does, with its defaults unless :meth:`compile` was called first);
        the input binding, the ranks' first-call check and the gradient hooks are Python
        dynamo cannot trace (it dies registering the backward hooks) or would guard on
        every step."""
        if not self.compiled:
            self.compile()
        return self.forward(*args, **kwargs)

    def compile(self, *args, **kwargs) -> None:
        """Run this rank's generated graph through ``torch.compile`` (``args`` and
        ``kwargs`` as it takes them: ``mode="max-autotune"``, ``backend=...``).

        Only the graph is compiled: what runs around it (input binding, gradient
        buckets and their collectives, ZeRO's gathers, the parameters' DTensor
        gradients) stays as it is, so optimizers, ``clip_grad_norm_`` and DCP work
        unchanged.  ``nn.Module.compile`` would compile the whole call, hooks included.
        A plan with pipeline stages or micro-batches compiles each stage's graph and
        runs its schedule, transfers and gradient sync eagerly around them, except under
        the zero-bubble schedule, which runs eagerly
        (:meth:`~autopar.runtime.pipeline.PipelineRunner.compile`).
        ``auto_parallel(..., compile=True)`` calls this."""
        cache_safe_views()  # torch's compile cache and the graph's views (compiled_cache.py)
        # other shapes' lowerings: one compiled template per family of them
        self.routes.templates.compile = (args, kwargs)
        if self.runner is not None:
            self.runner.compile(*args, **kwargs)
            return
        object.__setattr__(self, "_compiled", CompiledOrEager(self.inner, "the generated graph", *args, **kwargs))

    @property
    def compiled(self) -> bool:
        """Whether the graph runs through ``torch.compile`` (:meth:`forward`'s, or the
        pipeline stages' under :meth:`train_step`); ``False`` once compiling it failed
        and it runs eagerly (:class:`~autopar.runtime.compile_fallback.CompiledOrEager`)."""
        if self.runner is not None:
            return self.runner.compiled
        return self._compiled is not None and self._compiled.compiled is not None

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch (all micro-batches, every pipeline
        stage); gradients are left in ``.grad`` (summed into any already there).
        Returns the loss (detached), the same on every rank; for a model whose output
        is not a tensor (e.g. a Hugging Face ``ModelOutput``), its ``loss``.  With a
        :meth:`grad_scaler`, every backward is seeded with its scale (the loss returned
        is not scaled)."""
        scale = self._habits.loss_scale()  # fp16-mixed: grad_scaler()'s current scale
        if self.runner is None:
            out = self(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else out["loss"]
            (loss * scale if scale != 1.0 else loss).backward()
            return loss.detach()
        if self.pack_rows:
            kwargs = pack(kwargs, self.pack_rows, self.routes.pack_agree(self))[0]
        flat = self._bind(args, kwargs)
        self._route_runner().loss_scale = scale
        self.grad_sync.restart()  # the step's backwards add to what is there
        return self._scheduled(flat, evaluate=False)

    def _route_runner(self):
        """The schedule's runner of this call's shape (another shape's route runs its own,
        over its micro-batches' graphs)."""
        r = self._route
        return r.runner if r is not None and r.runner is not None else self.runner

    def _scheduled(self, flat: list, evaluate: bool) -> torch.Tensor:
        """The schedule's step on ``flat`` (forward and backward), or its forwards alone
        (``evaluate``): the batch's loss on every rank."""
        runner = self._route_runner()
        run = runner.evaluate if evaluate else runner.step
        if self.zero is not None and self.zero.stage == 3:
            with free_gathered_params():
                return run(flat)
        return run(flat)

    # ------------------------------------------------------------ training-loop habits
    def train(self, mode: bool = True) -> ParallelModule:
        """Switch dropout and batch norm between training and evaluation, as
        ``nn.Module.train`` does for the original model: the generated graphs' dropout
        and batch-norm calls take the mode as an argument, which is set here."""
        super().train(mode)
        self._habits.set_train_mode(mode)
        return self

    @property
    def rng(self) -> torch.Generator | None:
        """The module's own dropout generator (:meth:`manual_seed`); ``None`` while its
        dropouts draw from torch's default generator (:mod:`autopar.runtime.rng`)."""
        return self._habits.rng

    @rng.setter
    def rng(self, generator: torch.Generator | None) -> None:
        self._habits.rng = generator

    def manual_seed(self, seed: int) -> None:
        """Give the module's dropouts a generator of their own, seeded with ``seed`` (call
        with the same seed on every rank): they then draw what one process would draw
        after ``torch.manual_seed(seed)``, and no longer follow torch's generator."""
        self._habits.manual_seed(seed)

    @property
    def data_parallel_size(self) -> int:
        """How many different parts the global batch is split into: give
        ``DistributedSampler(num_replicas=pm.data_parallel_size, ...)``."""
        return self._habits.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which part of the global batch this rank holds (``DistributedSampler``'s
        ``rank``); tensor-parallel peers and pipeline stages share it."""
        return self._habits.data_parallel_rank

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
        return self._habits.grad_scaler(**kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over every rank and pipeline stage and
        return that norm (a plain tensor, equal on every rank).  Without a pipeline this
        equals ``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)``; with one, torch's
        function sees only this stage's parameters, so use this method."""
        return self._habits.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def trace(self, path, record_shapes: bool = False):
        """Record the real steps run inside ``with pm.trace("step.json") as t:`` (call
        ``t.step()`` after each) as a Chrome trace per rank, ``step.rank<r>.json``, to
        open beside the predicted one (``autopar plan --trace``); see
        :mod:`autopar.runtime.trace`."""
        return self._habits.trace(path, record_shapes)

    # ------------------------------------------------------------ state
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The original model's ``state_dict()`` keys; parameters are DTensors (this
        rank's shard, the plan's placements, ZeRO's ``Shard(0)`` included, the
        parameter's own shape), buffers plain tensors, all sharing storage with the
        module.  No collective: one rank alone may call it (a whole-tensor state dict is
        :meth:`full_state_dict`, collective)."""
        if self._dparams is None:
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        return self._state.state_dict(destination, prefix, keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """Load a state dict from :meth:`state_dict` (DTensors, any plan: they are
        redistributed to this plan's placements) or from the original model (whole
        tensors, sharded here).  With ``strict``, missing or unexpected keys raise.  One
        rank's :meth:`state_dict` written with ``torch.save`` and loaded on a rank whose
        shards differ raises :class:`~autopar.errors.ForeignShardError` on every rank
        (:mod:`autopar.module.habits`)."""
        if self._dparams is None:
            self._state.load_targets(state_dict)
            return nn.modules.module._IncompatibleKeys([], [])
        check_loaded_state_dict(state_dict, self)  # another rank's shards: every rank raises
        missing, unexpected = self._state.load_state_dict(state_dict, strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(model, optimizer) state dicts to save with DCP that load into any plan, on
        any number of ranks: torch's ``get_state_dict(self, optimizer,
        flatten_optimizer_state_dict=True)`` (every parameter's state, ZeRO's included,
        is a DTensor of the parameter's own shape, so DCP reshards it).  To resume, take
        these as the target, ``dcp.load`` into them and pass them to
        :meth:`load_checkpoint_state` (docs/training.md)."""
        return checkpoint_state(self, optimizer)

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, model_state: dict,
                              optim_state: dict) -> None:
        """Load what :meth:`checkpoint_state` gave (after ``dcp.load`` filled it) into
        this module and ``optimizer`` (torch's ``set_state_dict``)."""
        load_checkpoint_state(self, optimizer, model_state, optim_state)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an original-model state dict (whole tensors) by sharding it in."""
        self._state.load_targets(state_dict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict: original names, whole tensors.

        Collective when running: every rank must call it."""
        return self._state.full_state_dict()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, keyed by graph target."""
        return self._state.local_state_dict()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient under its original names (collective)."""
        return self._state.full_grads()

    @property
    def code(self) -> str:
        """The generated per-rank forward code, collectives included."""
        return self.inner.code

    def export(self, directory: str | Path) -> Path:
        """Write code, plan and weights so :func:`autopar.load` runs it without re-planning."""
        return export_module(self, Path(directory))

    def __deepcopy__(self, memo: dict) -> ParallelModule:
        """An independent working copy (:mod:`autopar.module.clone`): its forward reads its
        own parameters, so ``torch.optim.swa_utils.AveragedModel(pm)`` keeps a working EMA.
        Not collective."""
        return clone_module(self, memo)

    def save_pretrained(self, save_directory: str | Path, **kwargs) -> None:
        """Hugging Face's ``save_pretrained`` of the model passed to ``auto_parallel``,
        with the trained weights (``kwargs`` as it takes them).  Collective: every rank
        calls it (the whole state is gathered), rank 0 writes.  That model's own
        ``save_pretrained`` raises: it holds the weights from before ``auto_parallel``."""
        save_pretrained(self, save_directory, **kwargs)

    def generate(self, *args, **kwargs):
        """Hugging Face's ``generate`` of the model passed to ``auto_parallel``, with the
        trained weights (``args`` and ``kwargs`` as it takes them: ``input_ids=...,
        max_new_tokens=16, do_sample=False``); returns its output, on this rank's device.

        Collective: every rank calls it.  Like FSDP's ``summon_full_params``, it
        materializes the whole model on every rank: a working copy of that model
        decodes with HF's own loop and KV cache in eval mode under ``torch.no_grad``
        (``pm.train()`` / ``eval()`` are left as they were).  The copy is kept for the
        next calls, gathered again only after the weights changed, until a forward of
        ``pm`` runs with gradients enabled (training resumed) frees it.  The same
        inputs give the same output on every rank.
        A model without ``generate`` raises :class:`~autopar.errors.GenerateError`
        (:mod:`autopar.module.generate`)."""
        return generate(self, *args, **kwargs)

    def shutdown(self) -> None:
        """Destroy the process group (call once at the end of a torchrun script).

        The groups are destroyed here, not at interpreter exit: their worker threads
        end before this returns (:func:`autopar.runtime.mesh.release_groups` says why)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self._mesh_rt is not None:
            release_groups(self._mesh_rt)
        reset()


__all__ = ["ParallelModule"]
