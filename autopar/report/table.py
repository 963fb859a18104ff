"""One row per graph node: ``plan.table(nodes=True)``, ``autopar plan --nodes``.

The per-node table is for reading a decision in detail (or grepping ``--format tsv``);
the summary and the per-layer view (:mod:`autopar.report.summary`) come first.  Columns: the
node (or parameter) name, the aten op, the whole tensor's shape, its placement, the
collectives inserted on its inputs, its compute and communication per micro-batch and
its memory: activations kept for backward for ops, and parameters + gradients +
optimizer state for parameters (each per device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from autopar.cost_models import format_bytes
from autopar.report.summary import LEGEND, render

if TYPE_CHECKING:
    from autopar.plans.data import NodePlan, Plan

COLUMNS = ("node", "op", "shape", "placement", "inserted collectives", "compute ms", "comm ms",
           "memory per device")
"""Column headers of the node table (and of its TSV form)."""


def _rows(plan: Plan, show_views: bool) -> list[NodePlan]:
    return [n for n in plan.nodes.values()
            if show_views or not (n.kind == "op" and n.compute == 0 and not n.redistributions
                                  and n.memory == 0)]


def _cells(n: NodePlan) -> tuple[str, ...]:
    coll = "; ".join(f"{r.input}: {' '.join(r.steps)}" for r in n.redistributions
                     if any(not s.startswith("local") for s in r.steps))
    return (n.param or n.name, n.op, "x".join(map(str, n.shape[0])) if n.shape else "",
            ",".join(n.out_placements), coll, f"{n.compute * 1e3:.4f}", f"{n.comm * 1e3:.4f}",
            format_bytes(n.memory))


def node_table(plan: Plan, max_rows: int | None = None, show_views: bool = False, fmt: str = "text",
               width: int | None = None) -> str:
    """The node table as text (rich, sized to the terminal) or ``fmt="tsv"``."""
    if fmt not in ("text", "tsv"):
        raise ValueError(f"fmt must be 'text' or 'tsv', got {fmt!r}")
    rows = _rows(plan, show_views)
    if max_rows is not None:
        rows = rows[:max_rows]
    if fmt == "tsv":
        return "\n".join("\t".join(r) for r in [COLUMNS, *map(_cells, rows)])

    d = plan.decisions
    asked = "x".join(map(str, plan.request.mesh_shape or plan.mesh.shape))
    where = (f"each of {d.pipeline_stages} pipeline stages on sub-mesh "
             f"{'x'.join(map(str, plan.mesh.shape))} {plan.mesh.axis_names}"
             if d.pipeline_stages > 1 else f"axes {plan.mesh.axis_names}")
    t = Table(title=f"nodes of the plan for mesh {asked} ({where}); numbers per micro-batch",
              title_justify="left", caption_justify="left")
    for col in COLUMNS:
        # names stay whole (greppable, never cut mid-word); the other columns fold
        t.add_column(col, overflow="fold", no_wrap=col == "node")
    for n in rows:
        t.add_row(*_cells(n))
    total = len(_rows(plan, show_views))
    if len(rows) < total:
        t.add_row(f"... {total - len(rows)} more", *[""] * (len(COLUMNS) - 1))
    comm = max(0.0, plan.comm_seconds)
    t.caption = (f"per micro-batch: compute {plan.compute_seconds * 1e3:.4f} ms, communication "
                 f"{comm * 1e3:.4f} ms, gradient sync {plan.grad_sync_seconds * 1e3:.4f} ms; "
                 f"memory is activations for ops, params + grads + optimizer state for "
                 f"parameters.\n{LEGEND}")
    return render(t, width)


__all__ = ["COLUMNS", "node_table"]
