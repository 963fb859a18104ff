"""The module a plan runs as: :class:`ParallelModule`, this rank's part of a planned model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.placement import is_replicate, parse_placements
from autopar.plan import Plan
from autopar.sharding import gather_tensor, shard_tensor


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


__all__ = ["ParallelModule"]
