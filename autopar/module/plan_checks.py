"""The consistency checks a plan passes before :func:`autopar.module.apply.apply_plan`
applies it: the decisions that cannot run together, each refused with
:class:`~autopar.errors.PlanError` before any step changes the module.

The search never makes such a plan; these catch a plan file edited or written
elsewhere.  Every check reads the plan alone (and the model's frozen parameters), so
every rank refuses the same plan with the same message.
"""

from __future__ import annotations

from collections.abc import Collection

from autopar.errors import PlanError
from autopar.plans.data import Plan
from autopar.plans.placement import parse_placements, replicated_axes
from autopar.plans.schedules import conflict


def zero_axes_in_use(plan: Plan) -> tuple[int, ...]:
    """The plan's ZeRO axes of more than one device: empty when ZeRO shards nothing."""
    return tuple(a for a in plan.decisions.zero_axes if plan.mesh.shape[a] > 1)


def check_plan(plan: Plan, frozen: Collection[str] = ()) -> None:
    """Raise :class:`~autopar.errors.PlanError` when ``plan``'s decisions cannot run
    together; ``frozen``: the graph targets of frozen parameters (ZeRO leaves them
    whole)."""
    d = plan.decisions
    z = zero_axes_in_use(plan)
    # without a ZeRO axis of more than one device nothing is gathered: the chunks are moot
    if z and d.gather_chunks and (d.zero_stage not in (1, 2) or d.pipeline_stages > 1):
        raise PlanError("this plan gathers ZeRO's parameters in chunks (gather_chunks), which runs "
                        "with ZeRO-1 or 2 on one pipeline stage only; plan it again")
    if d.offload == "params" and (not z or d.zero_stage != 3 or _hsdp(plan, z, frozen)):
        raise PlanError("this plan keeps parameter shards in host memory (offload='params'), which "
                        "needs ZeRO-3 over every replicated axis of the parameters; plan it again")
    why = conflict(d.schedule, bool(d.recompute), d.zero_stage)
    if why:
        raise PlanError(f"this plan runs schedule {d.schedule!r} with {why}; plan it again")
    if d.zero_reduce_once and (d.zero_stage != 3 or d.pipeline_stages > 1):
        # the runner turns sync on at a rank's last backward only: other pipeline
        # chunks' sums would never be reduced
        raise PlanError("this plan reduces ZeRO-3 gradients once a step (zero_reduce_once) with "
                        f"zero_stage={d.zero_stage} and {d.pipeline_stages} pipeline stages: it "
                        "needs zero_stage=3 and no pipeline; plan it again")
    # copies run a schedule's micro-batches: one micro-batch on one stage runs as one copy
    schedule = d.pipeline_stages > 1 or d.micro_batches > 1
    if d.copies > 1 and schedule and (d.pipeline_stages > 1 or d.micro_batches != d.copies):
        raise PlanError(f"this plan runs {d.copies} copies with {d.micro_batches} micro-batches "
                        f"over {d.pipeline_stages} stages; plan it again")


def _hsdp(plan: Plan, z: tuple[int, ...], frozen: Collection[str]) -> bool:
    """Whether a parameter ZeRO shards over ``z`` (trainable, not 0-d, replicated on
    every axis of ``z``) is also replicated on another axis: its shard is then reduced
    there too, which host memory does not serve."""
    for n in plan.nodes.values():
        if n.kind != "param" or not n.param or n.param in frozen or not n.shape[0]:
            continue
        rep = set(replicated_axes(parse_placements(n.out_placements[0]), plan.mesh.shape))
        if set(z) <= rep and rep - set(z):
            return True
    return False


__all__ = ["check_plan", "zero_axes_in_use"]
