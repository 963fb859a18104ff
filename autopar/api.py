"""Public entry points: :func:`plan`, :func:`auto_parallel`, :class:`ParallelModule`."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar import validate
from autopar.capture.annotate import annotate
from autopar.capture.trace import Captured, capture, named_tensors
from autopar.cost_models import MeshSpec
from autopar.cost_models.live import default_on, live_mesh
from autopar.errors import ConfigError
from autopar.log import log
from autopar.module import habits
from autopar.module.parallel import ParallelModule
from autopar.module.shapes import structure_copy
from autopar.module.state import TensorInfo
from autopar.passes.lower import lower
from autopar.plans.data import Plan, compile_words
from autopar.plans.decisions import SEARCH_KNOBS, PlanOptions, decision_options, zero_axes
from autopar.plans.kinds import Precision
from autopar.plans.splits import micro_inputs
from autopar.runtime import agree
from autopar.runtime.inputs import BatchMode, InputBinder
from autopar.runtime.mesh import init_mesh, init_plan_mesh, local_device
from autopar.runtime.packing import example_rows, global_rows, packed_example
from autopar.search.entry import joint_plan

DEFAULT_TIMEOUT = 600.0  # seconds; gloo's own default is 30 minutes


def _seconds(timeout) -> float:
    """``timeout`` as seconds (a number or a ``datetime.timedelta``), validated."""
    t = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ConfigError(f"timeout={timeout!r}: expected a positive number of seconds or a "
                          "datetime.timedelta (default 600)")
    return float(t)


def _mesh(mesh: MeshSpec | str | tuple | None) -> MeshSpec:
    return validate.mesh(mesh)


def _capture_and_plan(model: nn.Module, example_inputs: tuple, mesh: MeshSpec,
                      example_kwargs: dict | None, opts: PlanOptions) -> tuple[Captured, Plan]:
    return joint_plan(model, example_inputs, mesh, opts, example_kwargs)


# what ``**decisions`` of plan() / auto_parallel() takes: the registry's forcing keywords
# (autopar.plans.decisions.DECISIONS) and the search's own knobs
_DECISION_KEYS = (*decision_options(), *SEARCH_KNOBS)


def _options(memory_budget, optimizer, time_limit, pins, decisions: Mapping,
             search: str = "auto", batch: str = "global") -> PlanOptions:
    """PlanOptions from the public keyword arguments; ``decisions`` forces plan-level
    choices (``zero_stage``, ``pipeline_stages``, ``micro_batches``, ``schedule``,
    ``recompute``) or widens the search (``explore=True``)."""
    bad = sorted(set(decisions) - set(_DECISION_KEYS))
    if bad:
        raise TypeError(f"unknown option(s) {bad}; known: {', '.join(_DECISION_KEYS)}")
    validate.options(memory_budget, optimizer, time_limit, search, decisions)
    validate.pins(pins)
    if batch not in {b.value for b in BatchMode}:
        raise ConfigError(f"batch must be 'global' or 'local', got {batch!r}")
    d = dict(decisions)
    if d.get("recompute") is not None:
        d["recompute"] = tuple(d["recompute"])
    if d.get("zero_axes") is not None:
        d["zero_axes"] = zero_axes(d["zero_axes"])
    if "precision" in d:
        d["precision"] = Precision.parse(d["precision"]).value
    if d.get("compile", False) is None:  # plan(): eager unless asked (no device to go by)
        del d["compile"]
    return PlanOptions(memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit,
                       pins=dict(pins or {}), search=search, batch=batch, **d)


def plan(model: nn.Module, example_inputs: tuple | None = None,
         mesh: MeshSpec | str | tuple | None = None, *,
         example_kwargs: dict | None = None, pins: Mapping | None = None,
         memory_budget: float | None = None, optimizer: str = "adamw",
         time_limit: float = 30.0, search: str = "auto", batch: str = "global",
         **decisions) -> Plan:
    """Plan only: capture, cost and search; needs no process group and no real devices.

    The model is captured called as ``model(*example_inputs, **example_kwargs)``; a
    Hugging Face model takes ``plan(model, example_kwargs=batch, mesh=...)``, as
    :func:`auto_parallel` does.

    ``search`` is ``"ilp"`` (exact), ``"drec"`` (fast, one mesh axis per round) or
    ``"auto"`` (the ILP when its problem fits the time limit, else D-Rec); the plan's
    ``solver.searcher`` says which ran.  ``time_limit`` is the search's seconds, capture
    not counted; the joint search gives 75% to exploring splits and the rest to planning
    the chosen one at full depth (``plan.timings`` says how each phase spent its share).

    ``decisions`` force plan-level choices, e.g. ``zero_stage=2``, ``pipeline_stages=2,
    micro_batches=4, schedule="1f1b"`` (or ``schedule="interleaved-1f1b", virtual_stages=2``:
    two model chunks per rank; ``pipeline_axis=1``: the stages carved from mesh axis 1,
    inside a node, rather than the searched axis), ``zero_axes=(0, 1)`` (ZeRO over both axes of a 2-D mesh,
    one group spanning them; one axis with the others replicated is HSDP), ``recompute=["blocks.1"]``, ``bucket_bytes=25 << 20``
    (fixed-size gradient buckets instead of the cost model's choice),
    ``reshard_after_forward=True`` (ZeRO-3 re-gathers every layer in backward; ``False``
    keeps every layer gathered from forward to backward, except recomputed ones and
    those with nothing to re-gather; unset, the planner keeps the most layers the
    memory budget allows, from the last),
    ``keep_grad_buffers=False`` (a new buffer per data-parallel gradient bucket each
    backward, freed with the gradients at ``zero_grad()``; ``True`` keeps them between
    steps, as DDP does; unset, they are kept where the memory budget allows),
    ``context_parallel="exchange"`` (attention on sequence chunks of q, k and v: Ulysses or
    ring attention), ``"gather-kv"`` (query rows, keys and values gathered) or ``"off"``;
    unset ones are searched.  ``compile=True`` prices the graph as ``torch.compile`` runs it
    (pointwise chains fused, :mod:`autopar.search.fusion`; default: eager).
    ``batch="local"`` plans for each data-parallel rank passing its part of the
    batch and getting its rows of batch-shaped outputs back, as :func:`auto_parallel`'s."""
    opts = _options(memory_budget, optimizer, time_limit, pins, decisions, search, batch)
    if example_inputs is None and example_kwargs is None:
        raise ConfigError("plan() needs the model's example call: example_inputs=(x,) "
                          "and/or example_kwargs={...} (a Hugging Face model: "
                          "example_kwargs=batch)")
    m = _mesh(mesh)
    if opts.pack:  # captured and priced packed (runtime/packing.py)
        example_kwargs = packed_example(model, example_kwargs, example_rows(m.shape, opts))
    return _capture_and_plan(model, tuple(example_inputs or ()), m, example_kwargs, opts)[1]


def _shared_plan(model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
                 example_kwargs: dict | None, given: Plan | None,
                 timeout: float = DEFAULT_TIMEOUT) -> tuple[Captured | None, Plan]:
    """Capture and search on rank 0 only and share the plan; the other ranks capture
    while they wait, and their capture is ``None`` when the plan needs another one
    (they capture for the plan then: :func:`_capture_for`).

    A solver stopped by its time limit may return different incumbents on different
    ranks; sharing makes every rank lower the identical plan, so all ranks issue the
    same collectives in the same order (and the other ranks skip the search).  An error
    on rank 0 is raised on every rank; the others wait for rank 0 at most ``timeout``
    seconds (:mod:`autopar.runtime.agree`).  No collective runs here: the caller checks
    that every rank arrived before its first one."""
    multi = dist.is_initialized() and dist.get_world_size() > 1
    if given is not None:
        return None, given
    if not multi or dist.get_rank() == 0:
        try:
            cap, p = _capture_and_plan(model, example_inputs, mesh, example_kwargs, opts)
        except Exception as e:
            if multi:
                agree.publish(agree.error_payload(e), timeout)
            raise
        if multi:
            agree.publish({"plan": p.to_json()}, timeout)
        return cap, p
    # while rank 0 plans, capture what the plan most likely needs (the whole batch unless
    # micro-batches are forced): the capture that followed the plan's arrival was on
    # every other rank's path to its first step.  A failure here is left to rank 0 to
    # report (it captures the same model) and the plan's own capture is taken instead
    micro = opts.micro_batches or 1
    try:
        early = _capture_at(model, example_inputs, example_kwargs, micro, opts.precision)
    except Exception:  # noqa: BLE001 - rank 0's error is the one every rank raises
        early = None
    payload = agree.wait(timeout)
    if "error" in payload:
        raise agree.rebuild(payload)
    p = Plan.from_json(payload["plan"])
    same = (p.decisions.micro_batches, p.decisions.precision) == (micro, opts.precision)
    return (early if same else None), p


def _capture_for(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
                 p: Plan) -> Captured:
    """Capture ``model`` for plan ``p``: its graph is the micro-batch's."""
    return _capture_at(model, example_inputs, example_kwargs, p.decisions.micro_batches,
                       p.decisions.precision)


def _capture_at(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
                micro_batches: int, precision: str) -> Captured:
    """Capture and annotate ``model`` at the size of one of ``micro_batches`` micro-batches."""
    cap = capture(model, *micro_inputs((tuple(example_inputs), dict(example_kwargs or {})),
                                       micro_batches),
                  precision=precision)
    annotate(cap.gm)
    return cap


def build_parallel_module(model: nn.Module, example_inputs: tuple, mesh: MeshSpec,
                          opts: PlanOptions, example_kwargs: dict | None = None,
                          runtime: bool | None = None, plan: Plan | None = None,
                          batch: str = "global", timeout: float = DEFAULT_TIMEOUT,
                          compile: bool | None = None, calibrate: Calibrate | None = None) -> ParallelModule:
    """Capture, plan (or take ``plan``), lower and shard: the body of :func:`auto_parallel`.
    ``calibrate`` (:func:`_calibration`): plan on the running job's measured numbers.
    Under a process group the module replaces ``model``'s parameters
    (:func:`autopar.module.habits.adopt`)."""
    if runtime is None:
        runtime = dist.is_initialized() or "RANK" in os.environ
    if plan is not None and plan.decisions.pack:
        rows = global_rows(plan.mesh.shape, plan.decisions.micro_batches)
        example_kwargs = packed_example(model, example_kwargs, rows)
    elif plan is None and opts.pack:
        example_kwargs = packed_example(model, example_kwargs, example_rows(mesh.shape, opts))
    with habits.building():
        pm = _build(model, example_inputs, mesh, opts, example_kwargs, runtime, plan, batch,
                    timeout, compile, calibrate)
    if runtime:
        habits.adopt(model, pm)
    return pm


def _build(model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
           example_kwargs: dict | None, runtime: bool, plan: Plan | None, batch: str,
           timeout: float, compile: bool | None, calibrate: Calibrate | None) -> ParallelModule:
    if runtime:
        validate.runnable_model(model)  # before joining: the same error on every rank
        # join the process group before planning so rank 0 can broadcast its plan
        if plan is not None:
            init_plan_mesh(plan, timeout=timeout)
        else:
            init_mesh(tuple(mesh.shape), timeout=timeout)
            if calibrate is not None:
                mesh = live_mesh(mesh.shape, base=calibrate.base)
    # priced as it runs: compiled or not, as compile= resolves on this rank's device
    opts = dataclasses.replace(opts, compile=compiles(compile))
    if plan is not None and plan.decisions.compile != opts.compile:
        log.info(f"the given plan was priced {'compiled' if plan.decisions.compile else 'eager'}; "
                 f"it runs {'compiled' if opts.compile else 'eagerly'} as compile= asks")
        why = {**plan.decisions.why, "compile": compile_words(opts.compile)}
        plan = dataclasses.replace(plan, decisions=dataclasses.replace(
            plan.decisions, compile=opts.compile, why=why))
    cap, p = _shared_plan(model, example_inputs, mesh, opts, example_kwargs, plan, timeout)
    try:
        if cap is None:
            cap = _capture_for(model, example_inputs, example_kwargs, p)
        t0 = time.perf_counter()
        gm = lower(cap.gm, p)
        p.timings["lower"] = time.perf_counter() - t0
    except Exception as e:
        if runtime:
            agree.all_arrived(timeout, failure=e)  # every rank raises it, none waits
        raise
    # every parameter and buffer, persistent or not, under every name (tied weights)
    full = {k: v.detach() for k, v in named_tensors(model).items()}
    if runtime:
        # rank 0 planned while the others waited, then every rank captured and lowered
        # at its own pace: meet before the first collective, bounded by ``timeout``
        # rather than the process group's own (maybe seconds) timeout
        agree.all_arrived(timeout)
        full = _from_rank0(full)
        _constants_from_rank0(gm, cap.aliases)
    info = TensorInfo.of(model, {n for names in cap.aliases.values() for n in names})
    binder = InputBinder.from_example(example_inputs, example_kwargs, cap.in_spec)
    pm = ParallelModule(gm, p, cap.aliases, cap.in_spec, cap.out_spec, cap.state_keys, full,
                        runtime, info=info, binder=binder, batch=batch)
    pm.training = model.training  # the mode the graph was captured in
    pm.routes.training = model.training  # new shapes are captured in it too
    if runtime:  # other shapes are captured from the model's structure (fake tensors)
        pm.routes.model, pm.routes.fake = structure_copy(model)
        # a shape whose graph is not the planned one: planned again, parameters kept
        pm.routes.replan = functools.partial(_replan, mesh=p.mesh, opts=opts, aliases=cap.aliases,
                                             timeout=timeout)
    return pm


def compiles(compile: bool | None) -> bool:
    """``compile=`` resolved: as given, or by default on where this process computes on
    a GPU (under NCCL), where the compiled module measured 0.67x the eager one's step
    (docs/benchmarks.md, one GPU); off on a CPU, where compiling a small GPT's graphs
    takes seconds for about the eager step (docs/training.md, "Compiling")."""
    if compile is not None:
        return bool(compile)
    return local_device().type == "cuda"


def _replan(model: nn.Module, args: tuple, kwargs: dict, plan: Plan, mesh: MeshSpec,
            opts: PlanOptions, aliases: Mapping[str, list[str]], timeout: float) -> tuple[Captured, Plan]:
    """``plan`` made again at the shape of ``(args, kwargs)``, every parameter pinned to its
    placement and ZeRO as planned, so the module's parameters serve it unchanged
    (:mod:`autopar.module.shapes`); rank 0 searches, every rank captures."""
    d = plan.decisions
    pins = {aliases.get(t, [t])[0]: pl for t, pl in plan.params().items()}
    o = dataclasses.replace(opts, pins=pins, zero_stage=d.zero_stage,
                            zero_axes=tuple(d.zero_axes) if d.zero_stage else None,
                            pipeline_stages=1, micro_batches=1, copies=None,
                            recompute=tuple(d.recompute), explore=False,
                            context_parallel=None)
    cap, p = _shared_plan(model, args, mesh, o, kwargs, None, timeout)
    return (cap if cap is not None else _capture_for(model, args, kwargs, p)), p


@dataclass(frozen=True)
class Calibrate:
    """Plan on a live calibration of the running job (:func:`autopar.cost_models.live.live_mesh`);
    ``base`` supplies what is not measured (memory capacity where given, the reserve)."""

    base: MeshSpec | None = None


def _calibration(calibrate: bool | None, mesh_arg, m: MeshSpec) -> Calibrate | None:
    """Whether ``auto_parallel`` plans on a live calibration: ``calibrate`` when given
    (True calibrates even with a described mesh, which then supplies what is not
    measured); by default (None) when the mesh names no machine (no mesh, or a shape:
    :func:`autopar.validate.describes_machine`) and ``AUTOPAR_CALIBRATE`` is not ``0``.
    Only in a process group: planning without one prices the presets."""
    if calibrate is not None and not isinstance(calibrate, bool):
        raise ConfigError(f"calibrate={calibrate!r}: expected True, False or None (default: "
                          "calibrate when no mesh description is named)")
    described = validate.describes_machine(mesh_arg)
    try:
        on = default_on()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if calibrate is False or (calibrate is None and (described or not on)):
        return None
    # on a CPU host without a description, calibration measures the host's memory; a GPU
    # (MeshSpec.for_device) or a named description keeps its device memory and reserve
    return Calibrate(base=m if described or torch.cuda.is_available() else None)


def _from_rank0(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank starts from rank 0's weights, as DDP does: ranks that built the model
    with different seeds would otherwise train different replicas, silently.  One
    broadcast per distinct tensor, in name order (the same on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return full
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for name in sorted(full):
        t = full[name]
        if id(t) not in seen:
            # NCCL broadcasts device tensors (cuda:LOCAL_RANK); gloo has no bool
            # collectives: carry bool buffers (masks) as bytes
            x = t.detach().to(local_device()).clone().contiguous()
            y = x.to(torch.uint8) if x.dtype == torch.bool else x
            dist.broadcast(y, src=0)
            seen[id(t)] = y.to(torch.bool) if x.dtype == torch.bool else y
        out[name] = seen[id(t)]
    return out


def _constants_from_rank0(gm: torch.fx.GraphModule, aliases: Mapping[str, list[str]]) -> None:
    """Tensors the forward reads that are neither parameters nor buffers (a plain tensor
    attribute, ``self.proj = torch.randn(8, 8)``, lifted by export as a constant) start
    as rank 0's too: each rank captured its own model, so they would otherwise differ
    across ranks built with different seeds, silently.  In place, in name order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    targets = sorted({n.target for n in gm.graph.nodes if n.op == "get_attr"} - set(aliases))
    for t in targets:
        *path, leaf = t.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        x = getattr(owner, leaf, None)
        if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter):
            setattr(owner, leaf, _from_rank0({t: x})[t].to(x.device))


def auto_parallel(model: nn.Module | Callable | None = None, *, example_inputs: tuple | None = None,
                  mesh: MeshSpec | str | tuple | None = None, pins: Mapping | None = None,
                  memory_budget: float | None = None, optimizer: str = "adamw",
                  time_limit: float = 30.0, example_kwargs: dict | None = None,
                  plan: Plan | None = None, search: str = "auto", batch: str = "global",
                  timeout: float = DEFAULT_TIMEOUT, compile: bool | None = None,
                  calibrate: bool | None = None, **decisions):
    """Plan and shard ``model`` for ``mesh``.

    * ``auto_parallel(model, example_inputs=..., mesh=...)`` returns a
      :class:`ParallelModule` (this rank's module under torchrun; planning-only
      without a process group).
    * ``@auto_parallel(mesh=...)`` on an ``nn.Module`` class or a factory returns a
      wrapper that plans on the first batch it is called with.

    ``pins`` fix placements (``{"fc1.weight": "RS(0)", "input:0": (Shard(0), Shard(0))}``)
    while the rest is searched; ``plan`` skips the search and applies a given Plan;
    ``decisions`` force plan-level choices and ``search`` picks the searcher, as in
    :func:`plan`.  Hugging Face models are passed as they are, with
    ``example_kwargs={"input_ids": x, "labels": y}``, and called as ``pm(**batch)``.

    ``batch="global"`` (default): every rank passes the whole global batch and gets every
    output whole.  ``batch="local"``: each data-parallel rank passes its own part, e.g. from
    ``DistributedSampler(ds, num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank)``,
    and gets its own rows of outputs whose dim 0 is the batch (logits), as with DDP; a
    scalar loss computed inside the model is still the global batch's.  The plan prices
    that (no gather of the logits); the example inputs are still the global batch.

    ``timeout`` (seconds or a ``timedelta``; default 600) bounds every wait: the process
    group autopar creates uses it for collectives, other ranks wait that long for rank
    0's plan, and a rank that does not arrive ends the job with an error naming it.

    ``compile``: whether the generated graph runs through ``torch.compile``
    (:meth:`ParallelModule.compile`).  The default (None) compiles where the module
    computes on a GPU and not on a CPU (:func:`compiles`); a compile that fails runs
    eagerly with one :class:`~autopar.runtime.compile_fallback.CompileFallbackWarning`.
    The plan is priced as the module runs: compiled, its pointwise chains as inductor's
    fused kernels (decision ``compile``, :mod:`autopar.search.fusion`).

    In a process group, with no mesh description named (``mesh`` is None or a shape),
    the plan is priced on the running job: a quick calibration of its collectives,
    compute, optimizer and host (about 10 s on a CPU host), kept on disk for the next run
    on the same cluster and read by rank 0, whose numbers every rank plans on
    (:mod:`autopar.cost_models.live`).  ``calibrate=False`` (or ``AUTOPAR_CALIBRATE=0``)
    prices the presets instead; a named preset, JSON or MeshSpec is planned on as given
    unless ``calibrate=True``.  ``plan.summary()`` says which numbers the plan used.
    """
    opts = _options(memory_budget, optimizer, time_limit, pins, decisions, search, batch)
    if plan is not None and plan.decisions.batch != batch:
        raise ConfigError(f"batch={batch!r} but the given plan was made for "
                          f"batch={plan.decisions.batch!r}: plan again, or pass batch="
                          f"{plan.decisions.batch!r}")
    m = _mesh(mesh)
    live = _calibration(calibrate, mesh, m)
    timeout = _seconds(timeout)
    direct = isinstance(model, nn.Module) and (example_inputs is not None or example_kwargs is not None)
    if not direct and batch != "global":
        # the decorator plans on the first batch it is called with, which under "local"
        # would be one rank's part taken for the global batch: refuse, never guess
        raise ConfigError("batch='local' needs the global batch to plan with: call "
                          "auto_parallel(model, example_inputs=<global batch>, batch='local') "
                          "instead of the decorator form")
    if model is None:
        return lambda target: _decorate(target, m, opts, compile, live)
    if direct:
        return build_parallel_module(model, tuple(example_inputs or ()), plan.mesh if plan else m,
                                     opts, example_kwargs, plan=plan, batch=batch, timeout=timeout,
                                     compile=compile, calibrate=live)
    return _decorate(model, m, opts, compile, live)


class LazyParallel(nn.Module):
    """Plans on the first call: wraps a model until its first batch is seen."""

    def __init__(self, model: nn.Module, mesh: MeshSpec, opts: PlanOptions,
                 compile: bool | None = None, calibrate: Calibrate | None = None) -> None:
        super().__init__()
        self._model = model
        self._mesh = mesh
        self._opts = opts
        self._compile = compile
        self._calibrate = calibrate
        self.pmodel: ParallelModule | None = None

    def forward(self, *args, **kwargs):
        """First call: plan on this batch; every call: run the parallel module."""
        if self.pmodel is None:
            self.pmodel = build_parallel_module(self._model, args, self._mesh, self._opts,
                                                kwargs or None, compile=self._compile,
                                                calibrate=self._calibrate)
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


def _decorate(target, mesh: MeshSpec, opts: PlanOptions, compile: bool | None = None,
              calibrate: Calibrate | None = None):
    if isinstance(target, type) and issubclass(target, nn.Module):
        @functools.wraps(target, updated=())
        def make(*a, **k):
            return LazyParallel(target(*a, **k), mesh, opts, compile, calibrate)
        return make
    if isinstance(target, nn.Module):
        return LazyParallel(target, mesh, opts, compile, calibrate)
    if callable(target):
        @functools.wraps(target)
        def factory(*a, **k):
            out = target(*a, **k)
            model = out[0] if isinstance(out, tuple) else out
            wrapped = LazyParallel(model, mesh, opts, compile, calibrate)
            return (wrapped, *out[1:]) if isinstance(out, tuple) else wrapped
        return factory
    raise TypeError(f"auto_parallel cannot wrap {type(target).__name__}")


__all__ = ["LazyParallel", "auto_parallel", "build_parallel_module", "plan"]
