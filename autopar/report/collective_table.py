"""Every collective of a step as text: what ``autopar plan --collectives`` prints."""

from __future__ import annotations

from autopar.cost_models import format_bytes
from autopar.plans.collective_record import Collective


def format_collectives(cols: list[Collective]) -> str:
    """``cols`` as a text table, one row per collective (what ``autopar plan
    --collectives`` prints), with per-step totals per pipeline rank."""
    rows = [("stage", "phase", "kind", "group", "bytes", "x/step", "what")]
    rows += [(str(c.stage), c.phase, c.kind, str(c.group), format_bytes(c.bytes), str(c.count),
              c.what) for c in cols]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r[:6], widths)) + "  " + r[6] for r in rows]
    for stage in sorted({c.stage for c in cols}):
        mine = [c for c in cols if c.stage == stage]
        lines.append(f"stage {stage}: {sum(c.count for c in mine)} collectives and messages per "
                     f"step, {format_bytes(sum(c.bytes * c.count for c in mine))} put in by each rank")
    return "\n".join(lines)


__all__ = ["format_collectives"]
