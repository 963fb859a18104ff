"""The pipeline's point-to-point messages of one step, as
:mod:`autopar.passes.split_stages` cuts the lowered graph and
:mod:`autopar.runtime.pipeline` sends them (part of :meth:`autopar.plans.Plan.collectives`).

Which values cross a stage boundary follows from the plan without lowering: a planned
value is read by its consumers in its own placement or in another one, and the
lowering emits each other placement once, right before its first consumer, in that
consumer's stage (``passes/lower.py``: its cache and ``tag_layers``).  So the
producer's value travels from its stage to the last stage that reads it as it is (or
that emits a redistribution of it), and a redistributed copy travels from where it was
emitted to the last stage that reads that placement; values computed from the model's
inputs alone are recomputed by every stage that needs them and never travel.  Each
crossing of a link ``s -> s + 1`` is one message per micro-batch from rank ``s`` to
rank ``s + 1`` (virtual stages under the interleaved schedule map to ranks mod ``p``),
and, when the value carries a gradient, one back in backward.  A value replicated over
sub-mesh axes of several ranks crosses as one slice per rank and is all-gathered over
those axes where it arrives, where the plan chose so (``Decisions.sliced_sends``); its
gradient is reduce-scattered there and sent back as slices
(:mod:`autopar.runtime.stage_wire`).  The step ends with the
last stage broadcasting the loss over the pipeline axis.  The shape header the runner
sends before the first micro-batch of the first step is not part of a steady step.
"""

from __future__ import annotations

import math

from autopar.capture.ir import info
from autopar.passes.split_stages import input_only
from autopar.plans.placement import local_shape, parse_placements, replicated_axes
from autopar.plans.splits import sends_sliced


def pipeline_messages(lister) -> None:
    """Add the point-to-point messages and the loss broadcast of a pipelined plan to
    ``lister`` (a :class:`autopar.search.step_collectives._Lister`)."""
    plan, d, gm = lister.plan, lister.d, lister.gm
    num, p, m = len(d.stages), lister.ranks, d.micro_batches
    # recomputed by each stage that reads them, as split_stages does
    copied = {n.name for n in input_only(list(gm.graph.nodes))}
    stage = lister.vstage

    # (value, placement) -> (stage it is made in, last stage that reads it)
    spans: dict[tuple[str, str], list[int]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name not in plan.nodes or n.name in copied:
            continue
        np_ = plan.nodes[n.name]
        t = stage(n.name)
        for i, u in enumerate(np_.inputs):
            if u in copied or lister.by_name[u].op != "call_function":
                continue
            own = plan.nodes[u].out_placements[0]
            want = np_.in_placements[i]
            spans.setdefault((u, own), [stage(u), stage(u)])
            if want != own:
                spans[(u, own)][1] = max(spans[(u, own)][1], spans.setdefault((u, want), [t, t])[0])
                spans[(u, want)][1] = max(spans[(u, want)][1], t)
            else:
                spans[(u, own)][1] = max(spans[(u, own)][1], t)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in out.all_input_nodes:  # the loss is summed and returned by the last stage
        if a.name in plan.nodes and a.name not in copied:
            key = (a.name, plan.nodes[a.name].out_placements[0])
            spans.setdefault(key, [stage(a.name), stage(a.name)])[1] = num - 1
    for (u, placement), (first, last) in sorted(spans.items()):
        if last <= first:
            continue
        outs = info(lister.by_name[u]).outputs
        pl = parse_placements(placement)
        numel = math.prod(local_shape(plan.nodes[u].shape[0], pl, lister.mesh))
        # replicated over axes of several ranks: each sends its slice, the receivers
        # all-gather them (runtime/stage_wire.py)
        replicated = replicated_axes(pl, lister.mesh)
        grad = lister.grad.get(u, False)
        for s in range(first, last):
            axes = replicated if sends_sliced(d, s) else ()
            t = math.prod(lister.mesh[a] for a in axes)
            nbytes = -(-numel // t) * (outs[0].dtype.itemsize if outs else 4)
            what = f"{u} ({placement}) stage {s} -> {s + 1}"
            lister.at = s % p
            lister.add("forward", "send", (), nbytes, what, m, group=2)
            if grad:
                lister.add("backward", "recv", (), nbytes, what, m, group=2)
            lister.at = (s + 1) % p
            lister.add("forward", "recv", (), nbytes, what, m, group=2)
            if axes:
                lister.add("forward", "all_gather", axes, nbytes, what, m)
            if grad and axes:  # the gradient's slices summed: a reduce-scatter of it whole
                lister.add("backward", "reduce_scatter", axes, nbytes * t, what, m)
            if grad:
                lister.add("backward", "send", (), nbytes, what, m, group=2)
    for r in range(p):  # runtime/pipeline.py _loss: float32, from the last stage
        lister.at = r
        lister.add("step", "broadcast", (), 4, "loss", 1, group=p)


__all__ = ["pipeline_messages"]
