"""Public entry points: :func:`plan`, :func:`auto_parallel`, :class:`ParallelModule`."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.annotate import annotate
from autopar.capture import Captured, capture
from autopar.cost_models import MeshSpec
from autopar.placement import is_replicate, parse_placements
from autopar.plan import Plan
from autopar.search import PlanOptions
from autopar.sharding import gather_tensor, shard_tensor


def _mesh(mesh: MeshSpec | str | tuple | None) -> MeshSpec:
    if isinstance(mesh, MeshSpec):
        return mesh
    if mesh is None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        return MeshSpec.preset("cpu-gloo", shape=(world,))
    if isinstance(mesh, str) and (mesh.endswith(".json") or mesh.lstrip().startswith("{")):
        return MeshSpec.from_json(mesh)
    if isinstance(mesh, str) and not mesh.replace("x", "").isdigit():
        return MeshSpec.preset(mesh)
    return MeshSpec.preset("cpu-gloo", shape=MeshSpec.parse_shape(mesh))


def _capture_and_plan(model: nn.Module, example_inputs: tuple, mesh: MeshSpec,
                      example_kwargs: dict | None, opts: PlanOptions) -> tuple[Captured, Plan]:
    from autopar.joint import joint_plan
    return joint_plan(model, example_inputs, mesh, opts, example_kwargs)


_DECISION_KEYS = ("zero_stage", "pipeline_stages", "micro_batches", "schedule", "recompute", "explore",
                  "blocks", "progress")


def _options(memory_budget, optimizer, time_limit, pins, decisions: Mapping,
             search: str = "auto") -> PlanOptions:
    """PlanOptions from the public keyword arguments; ``decisions`` forces plan-level
    choices (``zero_stage``, ``pipeline_stages``, ``micro_batches``, ``schedule``,
    ``recompute``) or widens the search (``explore=True``)."""
    bad = sorted(set(decisions) - set(_DECISION_KEYS))
    if bad:
        raise TypeError(f"unknown option(s) {bad}; known: {', '.join(_DECISION_KEYS)}")
    d = dict(decisions)
    if d.get("recompute") is not None:
        d["recompute"] = tuple(d["recompute"])
    return PlanOptions(memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit,
                       pins=dict(pins or {}), search=search, **d)


def plan(model: nn.Module, example_inputs: tuple, mesh: MeshSpec | str | tuple | None = None, *,
         example_kwargs: dict | None = None, pins: Mapping | None = None,
         memory_budget: float | None = None, optimizer: str = "adamw",
         time_limit: float = 30.0, search: str = "auto", **decisions) -> Plan:
    """Plan only: capture, cost and search; needs no process group and no real devices.

    ``search`` is ``"ilp"`` (exact), ``"drec"`` (fast, one mesh axis per round) or
    ``"auto"`` (the ILP when its problem fits the time limit, else D-Rec); the plan's
    ``solver.searcher`` says which ran.

    ``decisions`` force plan-level choices, e.g. ``zero_stage=2``, ``pipeline_stages=2,
    micro_batches=4, schedule="1f1b"``, ``recompute=["blocks.1"]``; unset ones are searched."""
    opts = _options(memory_budget, optimizer, time_limit, pins, decisions, search)
    return _capture_and_plan(model, tuple(example_inputs), _mesh(mesh), example_kwargs, opts)[1]


class ParallelModule(nn.Module):
    """This rank's part of a planned model.

    Parameters hold only this rank's shards; ``forward`` takes the same (whole)
    inputs as the original model and returns the same (replicated) outputs.  Without a
    process group the module is *planning only*: ``plan``, ``code`` and ``export``
    work; calling it raises.
    """

    def __init__(self, inner: nn.Module, plan: Plan, aliases: dict[str, list[str]],
                 in_spec, out_spec, state_keys: list[str], full_state: Mapping[str, torch.Tensor] | None,
                 runtime: bool) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        self.aliases = aliases
        self._in_spec, self._out_spec = in_spec, out_spec
        self.state_keys = state_keys
        self._placements = {t: parse_placements(p) for t, p in plan.params().items()}
        self._mesh_rt = None
        self.rank = 0
        self.runner = None
        self._param_nodes = {n.param: n for n in plan.nodes.values() if n.param}
        d = plan.decisions
        # graph target -> pipeline stage owning it (everything on stage 0 without a pipeline)
        self._owner = {n.param: d.stage_of(n.layer) if d.pipeline_stages > 1 else 0
                       for n in plan.nodes.values() if n.kind in ("param", "buffer") and n.param}
        if runtime:
            from autopar.runtime.mesh import init_mesh
            self._mesh_rt = init_mesh(tuple(plan.mesh.shape), stages=d.pipeline_stages)
            self.rank = dist.get_rank()
        # planning-only: keep the whole weights so export() can write every rank's shards
        self._full_state = dict(full_state) if (full_state is not None and not runtime) else None
        # the lowered graph before the runtime rewrites below (ZeRO-3 gathers, recompute,
        # stage split): export() writes it and load() re-applies them from the plan
        from autopar.export import snapshot
        self.lowered_graph = snapshot(inner.graph) if isinstance(inner, torch.fx.GraphModule) else None
        self.zero = None
        if full_state is not None:
            self._load_targets(full_state, self._coord())
        if runtime:
            self._start_zero()
            self._start_schedule()
            self._start_grad_sync()

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
        z = d.zero_axis
        if not d.zero_stage or z is None or self.plan.mesh.shape[z] == 1:
            return
        params = []
        for t, p in self._targets():
            if not self._mine(t):
                continue
            if t in self._placements and isinstance(p, nn.Parameter) and z in self._replicated_axes(t):
                params.append((t, tuple(a for a in self._replicated_axes(t) if a != z)))
        self.zero = Zero.install(self.inner, params, d.zero_stage, z)

    def _mine(self, t: str) -> bool:
        """True when this rank's pipeline stage holds target ``t``."""
        stage = self._mesh_rt.stage if self._mesh_rt is not None else 0
        return self._owner.get(t, 0) == stage

    def _start_schedule(self) -> None:
        """Recompute the planned layers; split pipeline stages; drop other stages' weights."""
        d = self.plan.decisions
        if d.recompute:
            from autopar.passes.recompute import recompute
            recompute(self.inner, set(d.recompute))
        if d.pipeline_stages == 1 and d.micro_batches == 1:
            return
        from autopar.passes.split_stages import split_stages
        from autopar.runtime.pipeline import PipelineRunner
        mine = split_stages(self.inner, self.plan)[self._mesh_rt.stage]
        for t in list(self.aliases):
            if not self._mine(t):
                owner, leaf = self._owner_of(t)
                if hasattr(owner, leaf):
                    delattr(owner, leaf)
        self.runner = PipelineRunner(mine, d.schedule, d.micro_batches, _Switches(self))

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
                    params.append((zp.shard, zp.other_axes))
                continue
            if t in self._placements and isinstance(p, nn.Parameter):
                params.append((p, self._replicated_axes(t)))
        self.grad_sync = GradSync(params)

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

    def _local_wholes(self, grads: bool = False) -> list[tuple[str, torch.Tensor | None]]:
        """(target, this rank's tensor in its planned placement) for every parameter and
        buffer, or their gradients; collective under ZeRO (gathers shards)."""
        zt = self.zero.targets() if self.zero is not None else set()
        out = []
        for t, p in self._targets():
            if t in zt:
                x = self.zero.local_whole(t, grad=grads)
            elif grads:
                x = p.grad if isinstance(p, nn.Parameter) else None
            else:
                x = p
            if self.plan.decisions.pipeline_stages > 1 and self._mesh_rt is not None:
                x = self._from_owner_stage(t, x, grads)
            out.append((t, x))
        return out

    def _from_owner_stage(self, t: str, x: torch.Tensor | None, grads: bool) -> torch.Tensor | None:
        """Broadcast ``t`` from the pipeline stage that holds it (collective over the
        pipeline axis; every rank walks the targets in the same order)."""
        from autopar.placement import local_shape
        m = self._mesh_rt
        node = self._param_nodes[t]
        has = torch.tensor([0 if x is None else 1])
        src = m.stage_rank(self._owner.get(t, 0))
        dist.broadcast(has, src=src, group=m.device_mesh.get_group(0))
        if not has.item():
            return None
        if x is None or not self._mine(t):
            pl = self._placements.get(t, parse_placements("R" * len(m.shape)))
            x = torch.empty(local_shape(tuple(node.shape[0]), pl, m.shape))
        x = x.detach().contiguous().clone()
        dist.broadcast(x, src=src, group=m.device_mesh.get_group(0))
        return x

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient under its original names (collective)."""
        out = {}
        for t, g in self._local_wholes(grads=True):
            if g is None or t not in self._placements:
                continue
            whole = gather_tensor(g, self._placements[t], self._mesh_rt.group)
            for n in self.aliases[t]:
                out[n] = whole
        return out

    def forward(self, *args, **kwargs):
        """Run this rank's part: same inputs and outputs as the original model."""
        if self._mesh_rt is None:
            raise RuntimeError("this ParallelModule is planning-only (no process group); "
                               "launch under torchrun to run it, or export() it")
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise ValueError(f"inputs do not match the traced call's structure: {spec} vs {self._in_spec}")
        if self.runner is not None:
            raise RuntimeError(
                f"this plan runs {self.plan.decisions.micro_batches} micro-batches over "
                f"{self.plan.decisions.pipeline_stages} pipeline stage(s): forward and backward are "
                "interleaved by the schedule, so call loss = module.train_step(*inputs) "
                "(it runs forward and backward) and then optimizer.step()")
        if self.zero is not None:
            self.zero.refresh()
            if self.zero.stage == 3:
                from autopar.runtime.zero import free_gathered_params
                with free_gathered_params():
                    out = self.inner(*flat)
                return pytree.tree_unflatten(list(out), self._out_spec) if self._out_spec is not None else out
        out = self.inner(*flat)
        return pytree.tree_unflatten(list(out), self._out_spec) if self._out_spec is not None else out

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch (all micro-batches, every pipeline
        stage); gradients are left in ``.grad`` (summed into any already there).
        Returns the loss (detached), the same on every rank."""
        if self.runner is None:
            loss = self(*args, **kwargs)
            loss.backward()
            return loss.detach()
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise ValueError(f"inputs do not match the traced call's structure: {spec} vs {self._in_spec}")
        if self.zero is not None:
            self.zero.refresh()
            if self.zero.stage == 3:
                from autopar.runtime.zero import free_gathered_params
                with free_gathered_params():
                    return self.runner.step(flat)
        return self.runner.step(flat)

    @property
    def code(self) -> str:
        """The generated per-rank forward code, collectives included."""
        return self.inner.code

    # ------------------------------------------------------------ checkpoints
    def _load_targets(self, full_state: Mapping[str, torch.Tensor], coord) -> None:
        zt = self.zero.targets() if getattr(self, "zero", None) is not None else set()
        for t, p in self._targets():
            names = self.aliases[t]
            src = next((full_state[n] for n in names if n in full_state), None)
            if src is None:
                raise KeyError(f"state dict has none of {names}")
            pl = self._placements.get(t, tuple(parse_placements("R" * len(coord))))
            if p is None and t not in zt:
                continue  # held by another pipeline stage
            local = shard_tensor(src.detach(), pl, self.plan.mesh.shape, coord)
            if t in zt:
                self.zero.load_whole(t, local)
                continue
            with torch.no_grad():
                if p.shape == local.shape and getattr(self, "_owns_params", False):
                    p.copy_(local)
                else:
                    self._replace(t, local.clone(), isinstance(p, nn.Parameter))
        # the captured graph shares tensors with the user's model: from here on this
        # module owns fresh ones, so the user's model is never modified
        self._owns_params = True

    def _replace(self, target: str, tensor: torch.Tensor, is_param: bool) -> None:
        *path, leaf = target.split(".")
        owner = self.inner.get_submodule(".".join(path)) if path else self.inner
        if is_param:
            owner.register_parameter(leaf, nn.Parameter(tensor))
        else:
            owner.register_buffer(leaf, tensor)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an original-model state dict (whole tensors) by sharding it in."""
        self._load_targets(state_dict, self._coord())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict: original names, whole tensors.

        Collective when running: every rank must call it."""
        whole = {}
        for t, p in self._local_wholes():
            pl = self._placements.get(t)
            if pl is None or self._mesh_rt is None:
                whole[t] = p.detach().clone()
            else:
                whole[t] = gather_tensor(p, pl, self._mesh_rt.group)
        out = {}
        for key in self.state_keys:
            for t, names in self.aliases.items():
                if key in names:
                    out[key] = whole[t]
        return out

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, keyed by graph target."""
        return {t: p.detach().clone() for t, p in self._local_wholes()}

    def export(self, directory: str | Path) -> Path:
        """Write code, plan and weights so :func:`autopar.load` runs it without re-planning."""
        from autopar.export import export_module
        return export_module(self, Path(directory))

    def shutdown(self) -> None:
        """Destroy the process group (call once at the end of a torchrun script)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        from autopar.runtime.mesh import reset
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


def _shared_plan(model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
                 example_kwargs: dict | None, given: Plan | None) -> tuple[Captured, Plan]:
    """Capture on every rank; search on rank 0 only and broadcast the plan.

    A solver stopped by its time limit may return different incumbents on different
    ranks; broadcasting makes every rank lower the identical plan, so all ranks issue
    the same collectives in the same order (and the other ranks skip the search)."""
    from autopar.joint import micro_inputs
    multi = dist.is_initialized() and dist.get_world_size() > 1
    cap, p = None, given
    if given is None and (not multi or dist.get_rank() == 0):
        cap, p = _capture_and_plan(model, example_inputs, mesh, example_kwargs, opts)
    if multi and given is None:
        box = [p.to_json() if p is not None else None]
        dist.broadcast_object_list(box, src=0)
        p = Plan.from_json(box[0])
    if cap is None:
        # the plan's graph is the micro-batch's: capture at that size
        cap = capture(model, micro_inputs(example_inputs, p.decisions.micro_batches), example_kwargs)
        annotate(cap.gm)
    return cap, p


def build_parallel_module(model: nn.Module, example_inputs: tuple, mesh: MeshSpec,
                          opts: PlanOptions, example_kwargs: dict | None = None,
                          runtime: bool | None = None, plan: Plan | None = None) -> ParallelModule:
    """Capture, plan (or take ``plan``), lower and shard: the body of :func:`auto_parallel`."""
    from autopar.passes.lower import lower

    if runtime is None:
        runtime = dist.is_initialized() or "RANK" in os.environ
    if runtime:
        # join the process group before planning so rank 0 can broadcast its plan
        from autopar.runtime.mesh import init_mesh
        if plan is not None:
            init_mesh(tuple(plan.mesh.shape), stages=plan.decisions.pipeline_stages)
        else:
            init_mesh(tuple(mesh.shape))
    cap, p = _shared_plan(model, example_inputs, mesh, opts, example_kwargs, plan)
    t0 = time.perf_counter()
    gm = lower(cap.gm, p)
    p.timings["lower"] = time.perf_counter() - t0
    full = {k: v for k, v in model.state_dict().items()}
    return ParallelModule(gm, p, cap.aliases, cap.in_spec, cap.out_spec, cap.state_keys, full, runtime)


def auto_parallel(model: nn.Module | Callable | None = None, *, example_inputs: tuple | None = None,
                  mesh: MeshSpec | str | tuple | None = None, pins: Mapping | None = None,
                  memory_budget: float | None = None, optimizer: str = "adamw",
                  time_limit: float = 30.0, example_kwargs: dict | None = None,
                  plan: Plan | None = None, search: str = "auto", **decisions):
    """Plan and shard ``model`` for ``mesh``.

    * ``auto_parallel(model, example_inputs=..., mesh=...)`` returns a
      :class:`ParallelModule` (this rank's module under torchrun; planning-only
      without a process group).
    * ``@auto_parallel(mesh=...)`` on an ``nn.Module`` class or a factory returns a
      wrapper that plans on the first batch it is called with.

    ``pins`` fix placements (``{"fc1.weight": "RS(0)", "input:0": (Shard(0), Shard(0))}``)
    while the rest is searched; ``plan`` skips the search and applies a given Plan;
    ``decisions`` force plan-level choices and ``search`` picks the searcher, as in
    :func:`plan`.
    """
    opts = _options(memory_budget, optimizer, time_limit, pins, decisions, search)
    m = _mesh(mesh)
    if model is None:
        return lambda target: _decorate(target, m, opts)
    if isinstance(model, nn.Module) and example_inputs is not None:
        return build_parallel_module(model, tuple(example_inputs), plan.mesh if plan else m, opts,
                                     example_kwargs, plan=plan)
    return _decorate(model, m, opts)


class LazyParallel(nn.Module):
    """Plans on the first call: wraps a model until its first batch is seen."""

    def __init__(self, model: nn.Module, mesh: MeshSpec, opts: PlanOptions) -> None:
        super().__init__()
        self._model = model
        self._mesh = mesh
        self._opts = opts
        self.pmodel: ParallelModule | None = None

    def forward(self, *args, **kwargs):
        """First call: plan on this batch; every call: run the parallel module."""
        if self.pmodel is None:
            self.pmodel = build_parallel_module(self._model, args, self._mesh, self._opts,
                                                kwargs or None)
            del self._model
        return self.pmodel(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        """The parallel module's (local) parameters; plan first by calling once."""
        if self.pmodel is None:
            raise RuntimeError("call the model on one batch first: it plans on the first batch")
        return self.pmodel.parameters(recurse)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pm = self.__dict__.get("_modules", {}).get("pmodel")
            if pm is not None:
                return getattr(pm, name)
            raise


def _decorate(target, mesh: MeshSpec, opts: PlanOptions):
    if isinstance(target, type) and issubclass(target, nn.Module):
        @functools.wraps(target, updated=())
        def make(*a, **k):
            return LazyParallel(target(*a, **k), mesh, opts)
        return make
    if isinstance(target, nn.Module):
        return LazyParallel(target, mesh, opts)
    if callable(target):
        @functools.wraps(target)
        def factory(*a, **k):
            out = target(*a, **k)
            model = out[0] if isinstance(out, tuple) else out
            wrapped = LazyParallel(model, mesh, opts)
            return (wrapped, *out[1:]) if isinstance(out, tuple) else wrapped
        return factory
    raise TypeError(f"auto_parallel cannot wrap {type(target).__name__}")


__all__ = ["LazyParallel", "ParallelModule", "auto_parallel", "build_parallel_module", "plan"]
