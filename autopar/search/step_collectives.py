"""Every collective one training step issues on a rank, as the plan predicts it: the
search lists them into ``Decisions.collectives`` (``plan.collectives()`` reads them back).

:func:`list_collectives` reads the captured graph and the plan and follows the same
rules the lowering and the runtime follow, in the same order of concerns:

* **edges**: each redistribution the lowering emits (one per producer and target
  placement, ``passes/lower.py``'s cache), and in backward its dual: an all-gather's
  is a reduce-scatter of the gathered tensor, a reduce-scatter's an all-gather, an
  all-reduce's an all-reduce, an all-to-all's the reverse all-to-all; only values that
  carry a gradient (they depend on a trainable parameter) have one;
* **outputs**: a scalar loss summed over some axes is one all-reduce left in flight
  (no backward), another output is redistributed to what the caller gets;
* **the ops' own exchanges**: the distributed cross-entropy's count of targets and,
  with classes sharded, its max, sum of exponentials and target logit
  (``runtime/ops.py``);
* **gradient sync**: the plan's buckets (``decisions.grad_buckets``), one all-reduce
  each over one group spanning the parameter's replicated axes (``runtime/grad_sync.py``);
* **ZeRO**: stages 1-2 reduce in 4 MiB buckets of padded shards back to front and
  all-gather the updated shards at the next forward (``phase="step"``); stage 3
  gathers each layer's shards once in forward, once more in backward (not the layers
  in ``decisions.zero_kept``) and reduce-scatters the layer's gradients (``runtime/zero.py``, ``runtime/zero3.py``).

* **context-parallel attention**: Ulysses' all-to-alls of q, k, v and the output.

* **pipelines**: every item above on the pipeline rank whose stage issues it
  (``Collective.stage``), and the point-to-point messages between stages
  (:mod:`autopar.search.messages`).
* **the call's shapes**: where ranks whose activations meet must call with equal shapes
  (:func:`autopar.runtime.call_check.agreement`), one all-gather of each rank's input
  dims over every rank before the call (``module/shapes.py``).

Forward and backward collectives repeat per micro-batch (``count``).  Not listed yet: ring attention's shifts and the uneven expert
dispatch of ``moe_experts`` (token counts depend on the routing); ``tests/dist/test_step_collectives.py`` compares the list with
:func:`autopar.runtime.trace.collective_log` on every kind it covers.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.grad_flow import dual, from_inputs, loss_output, requires_grad
from autopar.capture.ir import info
from autopar.plans.collective_record import Collective
from autopar.plans.placement import R, graph_batch, local_shape, parse_placements
from autopar.runtime.call_check import Agree, agreement, agreement_row
from autopar.runtime.compression import low_rank
from autopar.runtime.experts import MOE_EXPERTS
from autopar.runtime.grad_sync import fill_buckets, folded_axes, runs_by_axes
from autopar.runtime.token_weights import LossTargets, targets_of
from autopar.runtime.zero_layout import first_rows, padded_size
from autopar.search.messages import pipeline_messages
from autopar.sharding.redistribute import StepKind, plan_redistribution, step_shapes, sum_axes
from autopar.sharding.rules.attention import SDPA, CPImpl, context_layout
from autopar.sharding.rules.losses import count_axes
from autopar.sharding.rules.moe_experts import expert_axes

_DUAL = {StepKind.ALL_REDUCE: "all_reduce", StepKind.ALL_GATHER: "reduce_scatter",
         StepKind.REDUCE_SCATTER: "all_gather", StepKind.ALL_TO_ALL: "all_to_all"}
_FORWARD = {StepKind.ALL_REDUCE: "all_reduce", StepKind.ALL_GATHER: "all_gather",
            StepKind.REDUCE_SCATTER: "reduce_scatter", StepKind.ALL_TO_ALL: "all_to_all"}


class _Lister:
    def __init__(self, gm: fx.GraphModule, plan) -> None:
        self.gm, self.plan, self.mesh = gm, plan, tuple(plan.mesh.shape)
        self.d = plan.decisions
        self.out: list[Collective] = []
        # node name -> its value carries a gradient (floating, from a trainable parameter)
        self.grad = {n.name: g for n, g in requires_grad(gm).items()}
        self.by_name = {n.name: n for n in gm.graph.nodes}
        self.ranks = max(1, self.d.pipeline_stages)
        self.at = 0  # the pipeline rank the collectives being listed run on
        self._shapes: dict[str, tuple[int, ...]] = {}  # parameter target -> local shape
        self.moving: set[int] = set()  # axes activations cross ranks over (call_check.agreement)
        self.data = from_inputs(gm)  # values computed from the call's inputs
        self._items: dict[str, int] = {}  # parameter target -> bytes per element

    # ------------------------------------------------------------ helpers
    def _param(self, target: str) -> torch.nn.Parameter | None:
        try:
            return self.gm.get_parameter(target)
        except AttributeError:
            return None

    def _itemsize(self, name: str) -> int:
        outs = info(self.by_name[name]).outputs
        return outs[0].dtype.itemsize if outs else 4

    def vstage(self, name: str) -> int:
        """(Virtual) pipeline stage of planned node ``name``: its layer's, a getitem's
        its tuple's (``passes/split_stages.py``); 0 without a pipeline."""
        if self.ranks == 1:
            return 0
        node, g = self.plan.nodes[name], self.by_name[name]
        if not node.layer and g.op == "call_function" and g.target is operator.getitem:
            return self.vstage(g.args[0].name)
        return self.d.stage_of(node.layer) if node.layer else 0

    def rank(self, name: str) -> int:
        """Pipeline rank running planned node ``name``: its virtual stage mod the
        pipeline stages."""
        return self.vstage(name) % self.ranks

    def add(self, phase: str, kind: str, axes: Iterable[int], nbytes: int, what: str,
            count: int = 1, group: int | None = None) -> None:
        """List one collective on the current pipeline rank (``group``: its size when
        it is not the mesh axes', e.g. point-to-point)."""
        axes = tuple(axes)
        size = math.prod(self.mesh[a] for a in axes) if group is None else group
        self.out.append(Collective(phase, kind, axes, size, int(nbytes), what, count, self.at))

    def _redistribute(self, name: str, src: str, dst: str, what: str, grad: bool) -> None:
        s, t = parse_placements(src), parse_placements(dst)
        steps = plan_redistribution(s, t, self.mesh)
        shape = self.plan.nodes[name].shape[0]
        shapes = step_shapes(steps, local_shape(shape, s, self.mesh), self.mesh)
        item = self._itemsize(name)
        m = self.d.micro_batches
        back = []
        data = self.by_name[name] in self.data and bool(shape)
        for k, st in enumerate(steps):
            if st.kind not in _FORWARD:
                continue
            if data:
                self.moving.add(st.axis)
            self.add("forward", _FORWARD[st.kind], (st.axis,), math.prod(shapes[k]) * item, what, m)
            if grad:
                back.append(Collective("backward", _DUAL[st.kind], (st.axis,), self.mesh[st.axis],
                                       math.prod(shapes[k + 1]) * item, what, m, self.at))
        self.out.extend(reversed(back))

    # ------------------------------------------------------------ the step
    def run(self) -> list[Collective]:
        self._edges()
        self._outputs()
        self._cross_entropy()
        self._ulysses()
        self._grad_sync()
        if self.ranks > 1:
            pipeline_messages(self)
        self._experts()
        self._agreement()
        return self.out

    def _edges(self) -> None:
        seen: set[tuple[str, str]] = set()
        for n in self.gm.graph.nodes:
            if n.op != "call_function" or n.name not in self.plan.nodes or n.target is operator.getitem:
                continue
            for r in self.plan.nodes[n.name].redistributions:
                if (r.input, r.dst) in seen or r.src == r.dst:
                    continue
                seen.add((r.input, r.dst))
                self.at = self.rank(n.name)  # emitted before its first consumer, in its stage
                # a backward dual only where a gradient flows back (autopar/capture/grad_flow.py)
                self._redistribute(r.input, r.src, r.dst, f"{n.name} <- {r.input}",
                                   dual(self.by_name[r.input], n))

    def _outputs(self) -> None:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        rows = graph_batch(self.gm) if self.d.batch == "local" and self.d.local_axes is not None \
            else None
        rep = (R,) * len(self.mesh)
        self.at = (len(self.d.stages) - 1) % self.ranks if self.ranks > 1 else 0
        if self.ranks > 1 or self.d.micro_batches > 1:  # the runner returns the loss alone
            flat = [a for a in flat if isinstance(a, fx.Node) and info(a).outputs
                    and len(info(a).outputs) == 1 and not info(a).outputs[0].shape][:1]
        for a in flat:
            if not isinstance(a, fx.Node) or a.name not in self.plan.nodes or not info(a).outputs:
                continue
            outs = info(a).outputs
            dst = rep
            if rows is not None and len(outs) == 1 and outs[0].shape and outs[0].shape[0] == rows:
                dst = tuple(Shard(0) if i in self.d.local_axes else R for i in range(len(rep)))
            src = parse_placements(self.plan.nodes[a.name].out_placements[0])
            axes = sum_axes(src, dst, self.mesh) if len(outs) == 1 and not outs[0].shape else None
            if axes:
                self.add("forward", "all_reduce", axes, self._itemsize(a.name), f"output {a.name}",
                         self.d.micro_batches)
                continue
            self._redistribute(a.name, self.plan.nodes[a.name].out_placements[0],
                               "".join(str(p) for p in dst), f"output {a.name}",
                               info(a).returned_grad)

    def _cross_entropy(self) -> None:
        aten = torch.ops.aten
        m = self.d.micro_batches
        for n in self.gm.graph.nodes:
            if n.op != "call_function" or n.target is not aten.cross_entropy_loss.default \
                    or n.name not in self.plan.nodes:
                continue
            np_ = self.plan.nodes[n.name]
            self.at = self.rank(n.name)
            pl = parse_placements(np_.in_placements[0])
            shape = self.plan.nodes[np_.inputs[0]].shape[0]
            rows = count_axes(n, pl, self.mesh)
            classes = tuple(a for a, p in enumerate(pl) if self.mesh[a] > 1 and isinstance(p, Shard)
                            and p.dim == 1 and len(shape) == 2)
            if rows:  # the count of targets: one sum over the row axes
                self.add("forward", "all_reduce", rows, 8, f"{n.name} target count", m)
                if self._weighs_micro_batches(n):  # their counts, before the schedule
                    self.add("step", "all_reduce", rows, 8 * m, f"{n.name} micro-batch target counts", 1)
            if classes:
                nrows = local_shape(shape, pl, self.mesh)[0]
                item = self._itemsize(np_.inputs[0])
                grad = self.grad.get(np_.inputs[0], False)
                for a in classes:
                    self.add("forward", "all_reduce", (a,), nrows * item, f"{n.name} max", m)
                for a in classes:
                    for what in ("sum of exponentials", "target logit"):
                        self.add("forward", "all_reduce", (a,), nrows * item, f"{n.name} {what}", m)
                        if grad:
                            self.add("backward", "all_reduce", (a,), nrows * item,
                                     f"{n.name} {what}", m)

    def _weighs_micro_batches(self, n: fx.Node) -> bool:
        """Whether the schedule's runner weighs the micro-batches by the targets of
        cross-entropy ``n``, the model's loss (:mod:`autopar.runtime.token_weights`)."""
        if self.d.micro_batches <= 1 or self.d.copies > 1:
            return False
        flat, i = loss_output(self.gm, getattr(self.gm, "_out_spec", None))
        inputs = {x for x in self.gm.graph.nodes if x.op == "placeholder"}
        found = targets_of(flat[i], inputs) if i is not None else None
        return isinstance(found, LossTargets) and found.target is n.args[1]

    def _ulysses(self) -> None:
        """``runtime/context.py``: per context-parallel axis one all-to-all each of q,
        k, v and the output (the same again in backward); the all-to-all keeps a
        tensor's size, so each moves the rank's whole local tensor."""
        for n in self.gm.graph.nodes:
            if n.op != "call_function" or n.target is not SDPA or n.name not in self.plan.nodes:
                continue
            np_ = self.plan.nodes[n.name]
            ins = tuple(parse_placements(p) for p in np_.in_placements)
            layout = context_layout(n, ins, self.mesh)
            if layout is None or layout.impl is not CPImpl.ULYSSES:
                continue
            self.at = self.rank(n.name)
            sizes = [math.prod(local_shape(self.plan.nodes[u].shape[0], pl, self.mesh))
                     * self._itemsize(u) for u, pl in zip(np_.inputs[:3], ins[:3])]
            v_dim, q_dim = self.plan.nodes[np_.inputs[2]].shape[0][-1], self.plan.nodes[np_.inputs[0]].shape[0][-1]
            sizes.append(sizes[0] // q_dim * v_dim)  # the output: q's rows of v's width
            grads = [self.grad.get(u, False) for u in np_.inputs[:3]]
            for a in layout.cp_axes:
                self.moving.add(a)
                for what, b in zip(("q", "k", "v", "output"), sizes):
                    self.add("forward", "all_to_all", (a,), b, f"{n.name} Ulysses {what}",
                             self.d.micro_batches)
                    if any(grads):
                        self.add("backward", "all_to_all", (a,), b, f"{n.name} Ulysses {what}",
                                 self.d.micro_batches)

    def _experts(self) -> None:
        """Routed experts split over an axis (``moe_experts.localize_experts``) exchange
        tokens by the routing: every rank compares the call's shapes then (-1)."""
        for n in self.gm.graph.nodes:
            if n.op == "call_function" and n.target is MOE_EXPERTS and n.name in self.plan.nodes:
                ins = [parse_placements(p) for p in self.plan.nodes[n.name].in_placements]
                if any(expert_axes(ins)):
                    self.moving.add(-1)

    def _agreement(self) -> None:
        """The ranks' shape exchange before a call (``module/shapes.py``), where
        :func:`~autopar.runtime.call_check.agreement` asks for one: an all-gather over
        every rank, on every pipeline rank, of each rank's flat input dims."""
        if agreement(self.plan, self.moving) is Agree.NONE:
            return
        world = math.prod(self.mesh) * self.ranks  # the stages' sub-meshes tile the mesh
        dims = [len(info(n).outputs[0].shape) if info(n).outputs else -1
                for n in self.gm.graph.nodes if n.op == "placeholder"]
        for r in range(self.ranks):
            self.at = r
            self.add("forward", "all_gather", (), 8 * agreement_row(dims), "the call's shapes", group=world)

    # ------------------------------------------------------------ gradients
    def _params(self, rank: int) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """(target, elements of this rank's part, bytes per element, replicated axes of
        size > 1) of every trainable parameter pipeline rank ``rank`` holds, in graph
        order, once each."""
        out, seen = [], set()
        for n in self.gm.graph.nodes:
            if n.op != "get_attr" or n.target in seen or n.name not in self.plan.nodes:
                continue
            p = self._param(n.target)
            users = [u.name for u in n.users if u.name in self.plan.nodes]
            if p is None or not p.requires_grad or (users and self.rank(users[0]) != rank):
                continue
            seen.add(n.target)
            pl = parse_placements(self.plan.nodes[n.name].out_placements[0])
            # what runtime/compression.py reads of a bucket's gradients
            self._shapes[n.target] = tuple(local_shape(p.shape, pl, self.mesh))
            self._items[n.target] = p.element_size()
            axes = tuple(a for a, x in enumerate(pl) if x == R and self.mesh[a] > 1)
            out.append((n.target, math.prod(local_shape(p.shape, pl, self.mesh)), p.element_size(),
                        axes))
        return out

    def _grad_sync(self) -> None:
        for rank in range(self.ranks):
            self.at = rank
            self._rank_sync(self._params(rank))

    def _rank_sync(self, params: list[tuple[str, int, int, tuple[int, ...]]]) -> None:
        # the ZeRO axes of more than one device, as module/apply.py's apply_zero keeps them
        z, stage = tuple(a for a in self.d.zero_axes if self.mesh[a] > 1), self.d.zero_stage
        # 0-d parameters stay out of ZeRO (Shard(0) has no dim to cut); each ZeRO
        # parameter moves its padded dim-0 rows (runtime/zero_layout.py)
        zero = [(t, padded_size(self._shapes[t], [self.mesh[a] for a in sorted(z)]), item, axes)
                for t, n, item, axes in params
                if z and set(z) <= set(axes) and self._shapes[t] != ()]
        zt = {t for t, _, _, _ in zero}
        d = math.prod(self.mesh[a] for a in z) if zero else 1
        synced = [(t, n * item, axes) for t, n, item, axes in params if t not in zt]
        if stage == 3:
            synced += [(t, c * item, tuple(a for a in axes if a not in z))
                       for t, c, item, axes in zero]
            for t, _, _, _ in zero:  # GradSync reduces the shard: the first rank's rows
                shape = self._shapes[t]
                self._shapes[t] = (first_rows(shape[0], [self.mesh[a] for a in sorted(z)]), *shape[1:])
        self._buckets([s for s in synced if s[2]])
        if zero:
            self._zero(zero, z, d)

    def _buckets(self, params: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """``runtime/grad_sync.py``: the planned buckets split by axes, then what no
        bucket names in 4 MiB buckets back to front."""
        by = {t: (b, axes) for t, b, axes in params}
        placed: set[str] = set()
        for i, names in enumerate(self.d.grad_buckets):
            mine = [t for t in dict.fromkeys(names) if t in by and t not in placed]
            placed.update(mine)
            for axes, run in runs_by_axes(mine, lambda t: by[t][1]):
                self._bucket(axes, run, sum(by[t][0] for t in run), f"gradient bucket {i}")
        groups: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        for t, b, axes in reversed(params):
            if t not in placed:
                groups.setdefault(axes, []).append((t, b))
        for axes, sizes in groups.items():
            for bucket in fill_buckets(sizes, lambda tb: tb[1]):
                self._bucket(axes, [t for t, _ in bucket], sum(b for _, b in bucket),
                             "gradient bucket (4 MiB)")

    def _bucket(self, axes: tuple[int, ...], targets: list[str], nbytes: int, what: str) -> None:
        """One planned bucket's reduction as ``runtime/compression.py`` runs it under
        the plan's ``grad_compression``: bf16's all-to-all and gather of the padded
        bf16 bucket; PowerSGD's two all-reduces (the ``P`` factors with the gradients
        sent whole, then the ``Q`` factors) once its first whole steps are over."""
        kind, g = self.d.grad_compression, math.prod(self.mesh[a] for a in axes)
        if kind == "bf16" and g > 1:
            numel = sum(math.prod(self._shapes[t]) for t in targets)
            chunk = -(-numel // g)
            self.add("backward", "all_to_all", axes, chunk * g * 2, f"{what} (bf16)")
            self.add("backward", "all_gather", axes, chunk * 2, f"{what} (bf16 sums)")
        elif kind == "powersgd" and g > 1:
            p_bytes = q_bytes = 0
            for t in targets:
                shape, item = self._shapes[t], self._items[t]
                nmr = low_rank(shape, self.d.compression_rank)
                if nmr is None:
                    p_bytes += math.prod(shape) * item
                else:
                    p_bytes += nmr[0] * nmr[2] * item
                    q_bytes += nmr[1] * nmr[2] * item
            self.add("backward", "all_reduce", axes, p_bytes, f"{what} (PowerSGD P, whole vectors)")
            self.add("backward", "all_reduce", axes, q_bytes, f"{what} (PowerSGD Q)")
        else:
            self.add("backward", "all_reduce", axes, nbytes, what)

    def _zero(self, zero: list, z: tuple[int, ...], d: int) -> None:
        stage = self.d.zero_stage
        shards = [(t, c, item, tuple(a for a in axes if a not in z)) for t, c, item, axes in zero]
        if stage == 3:
            layers = {n.param: n.layer for n in self.plan.nodes.values() if n.param and n.layer}
            groups: dict[str, int] = {}
            for t, c, item, _ in shards:
                key = layers.get(t, t)
                groups[key] = groups.get(key, 0) + c * item
            m, kept = self.d.micro_batches, set(self.d.zero_kept)
            for key, nbytes in groups.items():
                self.add("forward", "all_gather", z, nbytes, f"ZeRO-3 {key}", m)
                if key not in kept:  # a kept layer's parameters are still whole in backward
                    self.add("backward", "all_gather", z, nbytes, f"ZeRO-3 {key} (re-gather)", m)
                self.add("backward", "reduce_scatter", z, nbytes * d, f"ZeRO-3 {key}",
                         1 if self.d.zero_reduce_once else m)
            return
        # runtime/zero.py: back to front, by padded whole-gradient bytes
        buckets = fill_buckets(reversed(shards), lambda s: s[1] * s[2] * d)
        for i, b in enumerate(buckets):
            padded = sum(c * item for _, c, item, _ in b) * d
            folded = folded_axes([s[3] for s in b]) if stage == 1 else ()
            self.add("backward", "all_reduce" if stage == 1 else "reduce_scatter",
                     tuple(sorted(z + folded)), padded, f"ZeRO-{stage} bucket {i}")
            if folded:  # stage 1: one all-reduce over the ZeRO and the shared other axes
                continue
            # the bucket's rank part over the other replicated axes: one all-reduce per
            # distinct set of them (runtime/zero.py's _reduce_other_axes)
            for other, run in runs_by_axes(b, lambda s: s[3]):
                self.add("backward", "all_reduce", other, sum(c * item for _, c, item, _ in run),
                         f"ZeRO-{stage} bucket {i} over {'+'.join(f'a{a}' for a in other)}")
        # the gathers after the step: every bucket, or the plan's chunks in forward order
        # after those no chunk holds, in their buckets (runtime/zero.py's refresh)
        chunked = {t for c in self.d.gather_chunks for t in c}
        whole = fill_buckets([s for s in reversed(shards) if s[0] not in chunked],
                             lambda s: s[1] * s[2] * d) if chunked else buckets
        for i, b in enumerate(whole):
            self.add("step", "all_gather", z, sum(c * item for _, c, item, _ in b), f"ZeRO-{stage} bucket {i}")
        size = {t: c * item for t, c, item, _ in shards}
        for i, c in enumerate(self.d.gather_chunks):
            self.add("step", "all_gather", z, sum(size.get(t, 0) for t in c), f"ZeRO-{stage} chunk {i}")


def list_collectives(gm: fx.GraphModule, plan) -> list[Collective]:
    """The collectives one training step of ``plan`` issues on a rank (see the module
    docstring); ``gm`` is the captured graph the plan was made for."""
    return _Lister(gm, plan).run()


__all__ = ["list_collectives"]
