"""The plan in words: what ``print(plan)`` and ``autopar plan`` open with.

:func:`summary` says the mesh as asked, each mesh axis's role (``TP8 (intra-node) x DP2,
ZeRO-1``), the predicted step split into compute, exposed and hidden communication and
bubble, throughput and MFU, memory per device by kind against the budget, each
plan-level decision with its reason, and the ops that run replicated for want of a
sharding rule.  :func:`layer_view` lists the layers with repeated ones folded
(``model.layers.0-21 x22: q_proj/k_proj/v_proj col; o_proj row; ...``).
The ``shapes`` line says the shape the step was priced at and the shapes the plan
serves (:mod:`autopar.report.shapes`).
:func:`summary_numbers` is the same content as plain data (units in the keys), written
into ``plan.json`` under ``"summary"``.

Axis roles and the layout phrase come from :mod:`autopar.plans.roles`.
"""

from __future__ import annotations

import io
import re
import shutil
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from autopar.cost_models import PRESET_NAMES, format_bytes
from autopar.plans.decisions import DECISIONS
from autopar.plans.placement import is_shard, parse_placements
from autopar.plans.roles import AxisRole, axis_roles, layout
from autopar.report.shapes import priced_shape, served_words

if TYPE_CHECKING:
    from autopar.plans.data import NodePlan, Plan

LEGEND = ("placements: one entry per mesh axis; S(d) = tensor dim d split over that axis, "
          "R = whole copy on every rank of it, P = partial sums awaiting a reduction "
          "(e.g. S(0)R: dim 0 split over the first axis, replicated over the second)")
"""One line explaining the placement notation used in tables and ``explain``."""

_UNSUPPORTED = re.compile(r"no sharding rule for op (\S+);")


def unsupported_ops(plan: Plan) -> list[str]:
    """Ops that run replicated because no sharding rule exists for them (from the plan's
    warnings), in the order first seen."""
    out: list[str] = []
    for w in plan.warnings:
        m = _UNSUPPORTED.search(w)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def summary_numbers(plan: Plan) -> dict:
    """The summary as plain data with units in the keys (``plan.json``'s ``"summary"``)."""
    d, r = plan.decisions, plan.request
    step = d.step_seconds or plan.objective
    world = plan.world_size
    flops = r.model_flops_per_step or 3.0 * sum(n.flops for n in plan.nodes.values()) * d.micro_batches
    out = {
        "layout": layout(plan),
        "mesh_shape_requested": list(r.mesh_shape) or list(plan.mesh.shape),
        "world_size": world,
        "axes": [{"name": a.name, "size": a.size, "role": a.kind, "link": a.link, "zero_stage": a.zero}
                 for a in axis_roles(plan)],
        "step_seconds": step,
        **{k: float(v) for k, v in d.breakdown.items()},
        "samples_per_step": d.global_batch,
        "tokens_per_step": r.tokens_per_step,
        "model_flops_per_step": flops,
        "samples_per_second": d.global_batch / step if step > 0 else 0.0,
        "tokens_per_second": r.tokens_per_step / step if step > 0 else 0.0,
        "peak_flops_per_device": plan.mesh.peak_flops,
        "mfu": flops / (step * world * plan.mesh.peak_flops) if step > 0 else 0.0,
        "memory_bytes": {k: float(v) for k, v in plan.memory.items()},
        "memory_budget_bytes": r.memory_budget_bytes or plan.mesh.usable_memory,
        "unsupported_ops": unsupported_ops(plan),
    }
    return out


def _rate(x: float) -> str:
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= f:
            return f"{x / f:.3g}{unit}"
    return f"{x:.3g}"


def _ms(x: float) -> str:
    if abs(x) < 1e-9:  # rounding left by differences of equal sums
        return "0 ms"
    return f"{x * 1e3:.3g} ms" if x >= 1e-3 else f"{x * 1e6:.3g} us"


def _decision_lines(plan: Plan) -> list[str]:
    """A line per decision the registry gives a summary label, in its order: its
    ``explain`` text, where the search wrote one (and, for a decision that changes
    the numbers, where it was taken)."""
    d = plan.decisions
    return [f"  {e.summary:<14} {d.why[e.explain]}" for e in DECISIONS
            if e.summary and e.explain in d.why and (e.summary_if is None or e.summary_if(d))]


def summary(plan: Plan) -> str:
    """The plan summary (about 15-25 lines; see the module docstring)."""
    n = summary_numbers(plan)
    d = plan.decisions
    asked = "x".join(map(str, n["mesh_shape_requested"]))
    # a preset's name says which numbers priced the plan; anything else (a live
    # calibration, a GPU's preset figures, a custom MeshSpec) gets a line of its own
    preset = plan.mesh.name in PRESET_NAMES
    lines = [f"autopar plan for mesh {asked} ({plan.world_size} devices, "
             + (f"preset {plan.mesh.name}, " if preset else "")
             + f"axes {', '.join(plan.mesh.axis_names)})"]
    if not preset:
        lines.append(f"  priced on      {plan.mesh.name}")
    lines.append(f"  layout         {n['layout']}")
    for a in axis_roles(plan):
        if a.size > 1:
            lines.append(f"    axis {a.name:<8} {a.words()}")
    if d.precision != "native":
        lines.append(f"  precision      {d.precision}: bf16 matmuls and attention, fp32 norms, "
                     "losses and master weights")
    if d.compile:
        lines.append("  compiled       torch.compile: priced with each pointwise chain one fused kernel")
    if d.batch == "local":
        axes = ", ".join(plan.mesh.axis_names[a] for a in d.local_axes or [])
        lines.append("  batch          local: each data-parallel rank passes its part"
                     + (f" and gets its rows back (split over {axes})" if axes else ""))
    step = n["step_seconds"]
    if d.breakdown:
        lines.append(f"  step time      {_ms(step)} predicted = compute {_ms(n['compute_seconds'])} "
                     f"+ exposed comm {_ms(n['exposed_comm_seconds'])} + bubble "
                     f"{_ms(n['bubble_seconds'])} + optimizer {_ms(n.get('optimizer_seconds', 0.0))}"
                     f"; hidden comm {_ms(n['hidden_comm_seconds'])} "
                     "(overlapped with backward)")
    else:
        lines.append(f"  step time      {_ms(step)} predicted")
    rate = (f"{_rate(n['tokens_per_second'])} tokens/s ({n['tokens_per_step']} per step), "
            if n["tokens_per_step"] else "")
    lines.append(f"  throughput     {rate}{_rate(n['samples_per_second'])} samples/s (global batch "
                 f"{d.global_batch}); MFU {n['mfu'] * 100:.3g}% of {plan.mesh.peak_flops / 1e12:.4g} "
                 "TFLOP/s per device")
    lines.append(f"  shapes         priced at {priced_shape(plan).words()}, the step above is per "
                 f"that shape; serves {served_words(plan, short=True)}")
    mem = plan.memory
    kinds = ", ".join(f"{k} {format_bytes(mem[k])}" for k in
                      ("params", "grads", "optimizer", "activations", "buffers", "transient")
                      if mem.get(k))
    budget, m = n["memory_budget_bytes"], plan.mesh
    # the default budget is the device less its reserve: say both, so 74.5 GiB on an
    # 80 GiB device is not read as a mistake
    held = (f" ({format_bytes(m.mem_capacity)} less a {format_bytes(m.mem_capacity - budget)} "
            "reserve)") if budget == m.usable_memory and budget < m.mem_capacity else ""
    lines.append(f"  memory         {format_bytes(mem.get('total', 0.0))} of "
                 f"{format_bytes(budget)}{held} per device on the fullest stage "
                 f"({mem.get('total', 0.0) / budget:.0%}): {kinds or 'nothing'}")
    if d.pipeline_stages > 1:
        # interleaved: virtual stage k runs on pipeline stage k % p, shown as "k@stage"
        where = (lambda k: f"{k}@{k % d.pipeline_stages}") if d.virtual_stages > 1 else str
        lines.append("  stages         " + "; ".join(
            f"{where(i)}: {', '.join(fold_keys(keys))}" for i, keys in enumerate(d.stages)))
    why = _decision_lines(plan)
    if why:
        lines.append("  decisions")
        lines += why
    unsup = n["unsupported_ops"]
    lines.append("  unsupported    " + (", ".join(unsup) + " (no sharding rule: run replicated)"
                                      if unsup else "none (every op has a sharding rule)"))
    s = plan.solver
    lines.append(f"  search         {s.searcher}/{s.backend} {s.status}"
                 + (f", gap {s.gap:.2%}" if s.gap is not None else ", gap unknown")
                 + f", {s.seconds:.2f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------- layers
def fold_keys(keys: list[str]) -> list[str]:
    """``["pre", "h.0", "h.1", "h.2", "post"]`` -> ``["pre", "h.0-2", "post"]``."""
    out: list[list] = []
    for key in keys:
        prefix, _, idx = key.rpartition(".")
        if out and idx.isdigit() and out[-1][0] == prefix and out[-1][2] == int(idx) - 1:
            out[-1][2] = int(idx)
            continue
        out.append([prefix, int(idx), int(idx)] if idx.isdigit() and prefix else [key, None, None])
    return [k if a is None else (f"{k}.{a}" if a == b else f"{k}.{a}-{b}") for k, a, b in out]


def _short(param: str, layer: str) -> str:
    rest = param[len(layer) + 1:] if layer not in ("pre", "post") and param.startswith(layer + ".") \
        else param
    parts = rest.split(".")
    if parts[-1] == "weight" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts[-2:]) if parts[-1] == "bias" and len(parts) > 1 else parts[-1]


def _param_words(n: NodePlan, roles: list[AxisRole], users: dict[str, list[str]]) -> str:
    words = []
    axes = [r for r in roles if r.kind != "PP"]
    pl = parse_placements(n.out_placements[0])
    embedding = any("embedding" in op for op in users.get(n.name, []))
    for a, p in enumerate(pl):
        if not is_shard(p) or a >= len(axes) or axes[a].size == 1:
            continue
        kind = axes[a].kind
        if kind in ("DP", "FSDP"):
            words.append("FSDP")
        elif len(n.shape[0]) == 2 and not embedding:
            words.append({0: "col", 1: "row"}.get(p.dim, f"S({p.dim})"))
        elif len(n.shape[0]) == 2:
            words.append({0: "vocab", 1: "hidden"}.get(p.dim, f"S({p.dim})"))
        elif len(n.shape[0]) == 1 and p.dim == 0:
            words.append("col")  # a bias split with its column-parallel weight's outputs
        else:
            words.append(f"S({p.dim})")
    return "+".join(words) or "rep"


def _drop_biases(names: list[str]) -> list[str]:
    """``["q", "q.bias", "ln.bias"]`` -> ``["q", "ln.bias"]``: a bias placed like its
    weight adds nothing to read."""
    return [x for x in names if not (x.endswith(".bias") and x[:-5] in names)]


def _layer_rows(plan: Plan) -> list[tuple[str, str, float, float, float, float]]:
    """(layer key, weights in words, compute seconds, communication seconds, activation
    bytes, param bytes) per layer."""
    roles = axis_roles(plan)
    users: dict[str, list[str]] = {}
    for n in plan.nodes.values():
        for u in n.inputs:
            users.setdefault(u, []).append(n.op)
    rows: dict[str, list] = {}
    for n in plan.nodes.values():
        key = n.layer or "post"
        row = rows.setdefault(key, [key, {}, 0.0, 0.0, 0.0, 0.0])
        if n.kind == "param":
            words = _param_words(n, roles, users)
            row[1].setdefault(words, [])
            short = _short(n.param or n.name, key)
            if short not in row[1][words]:
                row[1][words].append(short)
            row[5] += n.memory
        elif n.kind == "op":
            # an op's own exchanges (context-parallel attention, expert dispatch) are
            # inside its compute price; shown as communication, as a profiler shows them
            row[2] += n.compute - n.own_comm
            row[3] += n.comm + n.own_comm
            row[4] += n.memory
    out = []
    for key, groups, comp, comm, act, par in rows.values():
        if len(groups) == 1 and "rep" in groups and len(_drop_biases(groups["rep"])) > 6:
            text = "all replicated"
        else:
            # split weights first: they are what a reader looks for
            order = sorted(groups.items(), key=lambda kv: kv[0] == "rep")
            text = "; ".join(f"{'/'.join(_drop_biases(names))} {w}" for w, names in order) \
                or "no weights"
        out.append((key, text, comp, comm, act, par))
    return out


def _fold(rows: list[tuple]) -> list[tuple]:
    """Fold runs of consecutive layers ``prefix.i`` with the same weights' placements
    (rows are ``(key, text, *numbers)``; a folded row keeps its first layer's numbers)."""
    out: list[list] = []
    for key, text, *nums in rows:
        prefix, _, idx = key.rpartition(".")
        last = out[-1] if out else None
        if last and idx.isdigit() and last[3] == prefix and last[1] == text \
                and int(idx) == last[5] + 1:
            last[5] = int(idx)
            last[4] += 1
            continue
        out.append([key, text, nums, prefix if idx.isdigit() else None, 1,
                    int(idx) if idx.isdigit() else -1, idx])
    folded = []
    for key, text, nums, prefix, count, end, start in out:
        name = f"{prefix}.{start}-{end} x{count}" if count > 1 else key
        folded.append((name, text, *nums))
    return folded


def layer_view(plan: Plan, width: int | None = None) -> str:
    """Per-layer table with repeated layers folded: the weights' placements in words
    (col/row: tensor-parallel column/row split, FSDP: split over a data-parallel axis
    and gathered per use, rep: replicated), predicted compute (forward and backward)
    and communication (the layer's collectives and redistributions, on the critical
    path) per micro-batch, activations kept for backward, and the layer's parameter state
    per device (params, grads, optimizer), each per layer (a folded row gives one layer's
    numbers).  A line under it gives the step's gradient sync, hidden and exposed, which
    runs in buckets across layers."""
    t = Table(title="layers (repeated layers folded; numbers are per layer, per micro-batch)",
              title_justify="left")
    for col, just in (("layer", "left"), ("weights", "left"), ("compute", "right"),
                      ("comm", "right"), ("activations", "right"), ("param state", "right")):
        t.add_column(col, justify=just, overflow="fold")
    for name, text, comp, comm, act, par in _fold(_layer_rows(plan)):
        t.add_row(name, text, _ms(comp), _ms(comm), format_bytes(act), format_bytes(par))
    text = render(t, width)
    b = plan.decisions.breakdown
    hidden = b.get("hidden_comm_seconds", 0.0)
    if b and hidden > 0:
        text += (f"\ngradient sync (buckets across layers): {_ms(hidden)} hidden under backward; "
                 f"the step's exposed communication is {_ms(b.get('exposed_comm_seconds', 0.0))} "
                 f"of {_ms(plan.decisions.step_seconds)}")
    return text


def render(renderable, width: int | None = None) -> str:
    """Text of a rich renderable, sized to the terminal (120 columns when not one)."""
    buf = io.StringIO()
    w = width or shutil.get_terminal_size((120, 40)).columns
    Console(file=buf, width=w, force_terminal=False, color_system=None).print(renderable)
    return buf.getvalue().rstrip("\n")


__all__ = ["LEGEND", "fold_keys", "layer_view", "render", "summary", "summary_numbers",
           "unsupported_ops"]
