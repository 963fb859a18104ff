"""Reading a plan in words: the bodies of :meth:`Plan.explain <autopar.plans.Plan.explain>`
and :meth:`Plan.diff <autopar.plans.Plan.diff>`.

They are the longest read-only views of a plan and need nothing of its JSON handling;
keeping them here keeps :mod:`autopar.plans` to the plan's records and their accessors.
The methods on :class:`~autopar.plans.Plan` delegate to these functions.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from autopar.cost_models import format_bytes
from autopar.plans.decisions import explain_aliases
from autopar.report.shapes import explain_shapes
from autopar.report.summary import LEGEND, summary_numbers

if TYPE_CHECKING:
    from autopar.plans.data import Plan

__all__ = ["diff", "explain"]


def explain(plan: Plan, name: str) -> str:
    """What :meth:`Plan.explain <autopar.plans.Plan.explain>` returns for ``name``."""
    d = plan.decisions
    key = explain_aliases().get(name, name)
    if key in ("shapes", "shape"):
        return explain_shapes(plan)
    if key in d.why:
        return d.why[key]
    layers = {n.layer for n in plan.nodes.values()}
    if name in layers:
        where = f"stage {d.rank_of(name)} of {d.pipeline_stages}" if d.pipeline_stages > 1 \
            else "the only stage"
        if d.virtual_stages > 1:
            where += f" (virtual stage {d.stage_of(name)} of {len(d.stages)})"
        if f"layer:{name}" in d.why:
            return d.why[f"layer:{name}"] + f"; it runs on {where}"
        return f"{name} runs on {where} and is not recomputed: " + d.why.get(
            "recompute", "its activations fit the budget")
    n = plan._find(name)
    lines = [f"{n.name} ({n.op}, shape {n.shape}) on mesh {plan.mesh.shape} "
             f"axes {plan.mesh.axis_names}:",
             f"  chosen: inputs {n.in_placements} -> output {n.out_placements}; "
             f"compute {n.compute * 1e3:.4f} ms, communication {n.comm * 1e3:.4f} ms, "
             f"memory {format_bytes(n.memory)}"]
    if n.lowering:
        own = f"; its own exchanges {n.own_comm * 1e3:.4f} ms (inside the compute above)" \
            if n.own_comm > 0 else ""
        lines.append(f"  runs as: {n.lowering}{own}")
    for r in n.redistributions:
        lines.append(f"  input {r.input}: {r.src} -> {r.dst} via {', '.join(r.steps)} "
                     f"({r.seconds * 1e3:.4f} ms)")
    if n.alternatives:
        # deltas against the chosen strategy on the same footing (plans written before
        # local_seconds existed fall back to the best alternative)
        ref, what = (n.local_seconds, "chosen") if n.local_seconds else \
            (min(a.seconds for a in n.alternatives), "best alternative")
        if n.local_seconds:
            lines.append(f"  chosen, with its neighbours' choices fixed: {ref * 1e3:.4f} ms")
        lines.append("  alternatives (this node's cost with its neighbours' choices fixed):")
        for a in n.alternatives:
            lines.append(f"    inputs {a.inputs} -> {a.outputs}: {a.seconds * 1e3:.4f} ms"
                         f" ({(a.seconds - ref) * 1e3:+.4f} ms vs {what})")
    lines.append(f"  ({LEGEND})")
    return "\n".join(lines)


def diff(plan: Plan, other: Plan, max_nodes: int | None = None) -> str:
    """What :meth:`Plan.diff <autopar.plans.Plan.diff>` returns for ``plan`` (A) and
    ``other`` (B)."""
    a, b = summary_numbers(plan), summary_numbers(other)
    lines = [f"layout     A {a['layout']}", f"           B {b['layout']}",
             f"step       A {a['step_seconds'] * 1e3:.4f} ms, B {b['step_seconds'] * 1e3:.4f} ms"
             f" (B/A {b['step_seconds'] / a['step_seconds']:.3f})" if a["step_seconds"] else "",
             f"memory     A {format_bytes(plan.memory.get('total', 0))}, "
             f"B {format_bytes(other.memory.get('total', 0))} per device"]
    da, db = asdict(plan.decisions), asdict(other.decisions)
    for k in ("pipeline_stages", "pipeline_axis", "schedule", "virtual_stages", "micro_batches", "stages",
              "zero_stage", "zero_axis", "recompute"):
        if da[k] != db[k]:
            lines.append(f"{k:<10} A {da[k]}, B {db[k]}")
    nodes = []
    for name, x in plan.nodes.items():
        y = other.nodes.get(name)
        if y is None:
            nodes.append(f"  {name}: only in A")
        elif (x.in_placements, x.out_placements) != (y.in_placements, y.out_placements):
            nodes.append(f"  {name}: A {x.in_placements}->{x.out_placements}, "
                         f"B {y.in_placements}->{y.out_placements}")
    nodes += [f"  {name}: only in B" for name in other.nodes if name not in plan.nodes]
    lines.append(f"nodes      {len(nodes)} differ" + (":" if nodes else ""))
    shown = nodes if max_nodes is None else nodes[:max_nodes]
    lines += shown
    if len(shown) < len(nodes):
        lines.append(f"  ... {len(nodes) - len(shown)} more (autopar diff --all)")
    return "\n".join(x for x in lines if x)
