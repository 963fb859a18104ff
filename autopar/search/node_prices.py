"""Price strategies and edges with ``autopar.cost_models`` (the search's inputs).

Forward compute is priced by the roofline and multiplied by ``1 + backward_factor``
(backward costs about twice the forward); a redistribution in the forward has a dual
collective of the same size in the backward, so edges count twice; parameter gradient
synchronisation is priced once per step.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.annotate import VIEW_OPS, is_noop_cast
from autopar.capture.ir import META_KEY, TensorInfo, info, tensor_inputs
from autopar.cost_models import (
    MeshSpec,
    all_reduce_time,
    blocking_time,
    compute_time,
    optimizer_state_bytes,
    send_recv_time,
)
from autopar.plans.decisions import prices
from autopar.plans.placement import (
    Placements,
    is_shard,
    local_shape,
    replicated_axes,
    returned_placement,
)
from autopar.runtime.experts import MOE_EXPERTS
from autopar.runtime.ring_attention import ring_attention_cost_factors, ring_balanced
from autopar.search.edge_prices import EdgePrices, MeshTables, mesh_tables
from autopar.search.fusion import Fusion
from autopar.sharding.redistribute import sum_axes
from autopar.sharding.rules import OpStrategy
from autopar.sharding.rules.attention import (
    SDPA,
    CPImpl,
    context_layout,
    sdpa_args,
    sdpa_placements,
)
from autopar.sharding.rules.channel_norms import batch_norm_axes, batch_norm_training
from autopar.sharding.rules.moe_experts import expert_axes
from autopar.sharding.rules.statistics import SPLIT_REDUCTIONS, split_all_reduces, split_axes

aten = torch.ops.aten


@prices("precision")
def op_dtype(node: fx.Node):
    """The dtype an op's kernel computes in: its output's (a matmul's inputs and output
    share it); the experts op's expert weights' (its output keeps the residual's)."""
    if node.target is MOE_EXPERTS:
        return info(node.args[3]).out.dtype
    ni = info(node)
    return ni.outputs[0].dtype if ni.outputs else None


# ops whose backward reads their own result: it is kept whatever reads it next
SAVES_OUTPUT = frozenset({
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
    aten._safe_softmax.default, aten.exp.default, aten.sigmoid.default, aten.tanh.default,
    aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.relu.default,
})


# ops whose backward reads none of their tensor inputs, only shapes or nothing: an
# output that only they read (through views) is not kept for backward.  A cast saves
# nothing and its consumers keep the cast copy; a residual add, a mean, a concatenation
# pass the gradient on untouched; a cross-entropy keeps its log-probabilities, not the
# logits (priced on it: CostModel.node_memory).  Any op not here is taken to keep
# what it reads, as a matmul, a product, a power or an activation function does.
SAVES_NO_INPUT = frozenset({
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.neg.default,
    aten.mul.Scalar, aten.div.Scalar, aten.cat.default, aten.stack.default,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.clone.default, aten.constant_pad_nd.default, aten.pad.default,
    aten.cross_entropy_loss.default,
})


def kept_for_backward(node: fx.Node) -> bool:
    """Whether autograd keeps ``node``'s output for backward: its op reads its own
    result (:data:`SAVES_OUTPUT`: an fp32 softmax cast to bf16 keeps both), the graph
    returns it (the caller holds it), or an op reads it (through views and no-op casts)
    that is not known to save none of its inputs (:data:`SAVES_NO_INPUT`).  A norm's
    fp32 output cast to bf16 for the next matmul is kept once, in bf16; HF RMSNorm's
    squared input, read only by a mean, not at all."""
    if node.target in SAVES_OUTPUT:
        return True
    stack = list(node.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and (u.target in VIEW_OPS or is_noop_cast(u)):
            stack.extend(u.users)
        elif u.op != "call_function" or u.target not in SAVES_NO_INPUT:
            return True
    return False


def compute_floor(node: fx.Node, mesh: MeshSpec, backward_factor: float = 2.0) -> float:
    """Device-seconds below which no placement prices ``node``'s forward + backward
    compute: its FLOPs at the roofline's compute bound (the dtype's peak times
    ``flops_efficiency``).  :meth:`CostModel.op_time` divides the FLOPs by at most the
    devices that share the op and only adds (memory-bound time, launch floor, attention
    imbalance), so a layer spread over ``d`` devices takes at least ``floor / d``."""
    if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem:
        return 0.0
    flops = info(node).flops
    if not flops:
        return 0.0
    return flops / (mesh.peak_for(op_dtype(node)) * mesh.flops_efficiency) * (1.0 + backward_factor)


def kernel_terms(node: fx.Node, mesh: MeshSpec, backward_factor: float = 2.0,
                 fusion: Fusion | None = None) -> tuple[float, list[float]] | None:
    """What :meth:`CostModel.op_time` prices ``node`` from, on one device with whole
    tensors: (its FLOPs at the dtype's peak times ``flops_efficiency``, in seconds, and
    the bytes of each tensor input, then of its outputs), forward + backward; ``None``
    when the op launches no kernel (views, no-op casts, nothing to compute or move).  A
    placement over ``d`` devices divides each at most by ``d`` and
    :func:`~autopar.cost_models.compute_time` takes the max of the two and the launch
    floor, so the sum of those maxima over a layer bounds its time below
    (:func:`autopar.search.stages.layer_stats.kernel_floor`).  Under ``fusion`` (a
    compiled graph) a fused op's tensors that never reach memory count 0 bytes."""
    if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem \
            or is_noop_cast(node):
        return None
    ni = info(node)
    tensors = [info(u).out for u in tensor_inputs(node)] + list(ni.outputs)
    sizes = [float(t.nbytes) if keep else 0.0 for t, keep in zip(tensors, in_memory(node, fusion))]
    if not ni.flops and not any(sizes):
        return None
    scale = 1.0 + backward_factor
    flops = ni.flops / (mesh.peak_for(op_dtype(node)) * mesh.flops_efficiency) * scale if ni.flops else 0.0
    return flops, [b * scale / mesh.mem_bandwidth for b in sizes]


def in_memory(node: fx.Node, fusion: Fusion | None) -> list[bool]:
    """Per tensor input of ``node``, then per output: whether its kernel moves it
    through memory (always, unless ``fusion`` fuses ``node``: then its group's external
    inputs and outputs only, :class:`~autopar.search.fusion.Fused`)."""
    f = fusion.of(node) if fusion is not None else None
    if f is None:
        return [True] * (len(tensor_inputs(node)) + len(info(node).outputs))
    return [*f.inputs, *f.outputs]


def precision_warning(gm, mesh: MeshSpec, precision: str) -> str | None:
    """A warning when the model runs most of its FLOPs in fp32 (``precision="native"``
    on an fp32 model) on a mesh whose peak is for another dtype (GPU presets: bf16
    tensor cores): the plan is priced at the fp32 rate, right for what will run, but
    likely not what the user meant."""
    if precision != "native" or mesh.fp32_peak_flops is None or mesh.fp32_peak_flops >= mesh.peak_flops:
        return None
    flops: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and META_KEY in n.meta and info(n).flops:
            flops[op_dtype(n)] = flops.get(op_dtype(n), 0.0) + info(n).flops
    fp32 = flops.get(torch.float32, 0.0) + flops.get(torch.float64, 0.0)
    total = sum(flops.values())
    if not total or fp32 <= 0.5 * total:
        return None
    return (f"the model computes {fp32 / total:.0%} of its FLOPs in float32: the plan prices "
            f"them at mesh {mesh.name!r}'s fp32 rate ({mesh.fp32_peak_flops / 1e12:.4g} TFLOP/s "
            f"per device), not its {mesh.peak_flops / 1e12:.4g} TFLOP/s tensor-core peak; "
            "precision='bf16-mixed' plans 16-bit matmuls with fp32 master weights")


ARRIVAL_TIE = 1e-7
"""Seconds that break a tie toward taking a local batch input as it arrives
(:meth:`CostModel.arrival_cost`): far below any op's or collective's price."""


@dataclass
class CostModel(EdgePrices):
    """Prices for one mesh and optimizer; caches redistribution prices."""

    mesh: MeshSpec
    optimizer: str = "adamw"
    backward_factor: float = 2.0
    local_rows: int | None = None
    """The global batch when outputs are returned per data-parallel rank (``batch="local"``,
    :func:`autopar.plans.placement.returned_placement`); None: outputs are returned replicated."""
    arrival_tie: bool = True
    """Break ties toward batch inputs taken as they arrive (:meth:`arrival_cost`); off
    where the user pinned an input (a layout the user chose for the batch)."""
    fusion: Fusion | None = None
    """The compiled graph's fused groups (decision ``compile``, :func:`autopar.search.fusion.fuse`):
    each fused op priced by the bytes its kernel moves, the launch once per group, a
    fused intermediate kept for no backward; None: the eager graph, op by op."""
    _tables: MeshTables = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # redistribution prices depend on the mesh alone: every cost model of one mesh
        # (a joint search prices a shallow copy, then the full depth, then each
        # micro-batch size) shares them
        self._tables = mesh_tables(self.mesh)

    # ------------------------------------------------------------ edges
    def output_redistribution(self, src: Placements, dst: Placements, t: TensorInfo,
                              dual: bool = True) -> float:
        """Seconds per step to make a model output ``dst``: forward and backward dual,
        except for a scalar (the loss) that only needs all-reduces: its backward needs
        no communication (every rank seeds the same gradient) and its forward sum is
        left in flight, waited for only when the value is read, after the step's work
        (:mod:`autopar.runtime.pending`), so nothing of it is on the step's path.
        ``dual=False``: an output the step does not differentiate, forward only."""
        if not t.shape and sum_axes(src, dst, self.mesh.shape) is not None:
            return 0.0
        return self.redistribution(src, dst, t, dual)

    def output_cost(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step to return ``node``'s output (a model output) where the caller
        gets it (:func:`autopar.plans.placement.returned_placement`)."""
        t = info(node).out
        dst = returned_placement(s.outputs[0], t.shape, self.local_rows)
        # an output the step does not differentiate (a model's logits beside its loss)
        # gets no gradient: the forward's collectives alone (autopar/capture/grad_flow.py)
        return self.output_redistribution(s.outputs[0], dst, t, info(node).returned_grad)

    # ------------------------------------------------------------ nodes
    def node_cost(self, node: fx.Node, s: OpStrategy) -> float:
        """Compute (forward + backward) plus the op's own communication."""
        if node.op == "get_attr" and info(node).param is not None:
            return self.grad_sync(s.outputs[0], info(node).out)
        if node.op == "placeholder":
            return self.arrival_cost(node, s)
        return sum(self.op_time(node, s))

    def arrival_cost(self, node: fx.Node, s: OpStrategy) -> float:
        """Under ``batch="local"`` a batch input arrives as each data-parallel rank's rows:
        a layout that does not take it so is given the whole batch by an all-gather first,
        and ties the ranks' shapes together (ranks holding different rows or lengths
        cannot run it: :mod:`autopar.module.shapes`).  Priced at :data:`ARRIVAL_TIE` per
        axis it does not split the rows on, so that among layouts of equal price the one
        taking the rows as they arrive wins; not at the gather's latency, since on a
        tensor-parallel axis, which shares the rows, nothing is gathered."""
        t = info(node).out
        if not self.arrival_tie or self.local_rows is None or not t.shape or t.shape[0] != self.local_rows:
            return 0.0
        pl = s.outputs[0]
        return ARRIVAL_TIE * sum(1 for a, n in enumerate(self.mesh.shape)
                                 if n > 1 and not (isinstance(pl[a], Shard) and pl[a].dim == 0))

    def op_time(self, node: fx.Node, s: OpStrategy) -> tuple[float, float]:
        """(compute forward + backward, the op's own communication) of an op under
        strategy ``s``: the collectives its local form issues itself (context-parallel
        attention, expert dispatch, distributed cross-entropy), not those on its edges."""
        if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem \
                or is_noop_cast(node):
            return 0.0, 0.0
        ni = info(node)
        div = 1
        for a, n in enumerate(self.mesh.shape):
            if any(is_shard(p[a]) for p in (*s.inputs, *s.outputs)):
                div *= n
        local_bytes = sum(
            math.prod(local_shape(x.shape, p, self.mesh.shape)) * (x.nbytes / max(x.numel, 1))
            for x, p, keep in zip([info(u).out for u in tensor_inputs(node)] + list(ni.outputs),
                                  list(s.inputs) + list(s.outputs), in_memory(node, self.fusion))
            if keep
        )
        fused = self.fusion.of(node) if self.fusion is not None else None
        t = compute_time(self.mesh, ni.flops / div, local_bytes, op_dtype(node),
                         launch=fused is None or fused.launches)
        if node.target is SDPA:
            t *= self.attention_compute_factor(node, s)
        return t * (1.0 + self.backward_factor), self.own_comm(node, s)

    def own_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """Collectives an op issues inside its lowering (vocab-parallel cross-entropy,
        context-parallel attention).  A batch-sharded cross-entropy's token count is
        all-reduced asynchronously from the top of the forward, where the labels are
        sliced, and waited for at the loss (passes/localize.py ``_hoist_count``): an
        8-byte collective behind the whole forward, hidden here; the stage exposes the
        part the forward does not hide (:func:`autopar.search.stages.step_terms.count_exposed`:
        nearly all of it where ranks share cores, and all of it under pipeline stages,
        where it starts at the loss)."""
        if node.target is SDPA:
            return self.attention_comm(node, s)
        if node.target is MOE_EXPERTS:
            return self.experts_comm(node, s)
        if node.target in SPLIT_REDUCTIONS:
            return self.split_reduction_comm(node, s)
        if node.target is aten.batch_norm.default:
            return self.batch_norm_comm(node, s)
        if node.target is not aten.cross_entropy_loss.default:
            return 0.0
        x = info(node.args[0]).out
        rows = math.prod(local_shape(x.shape, s.inputs[0], self.mesh.shape)[:1])
        total = 0.0
        for a, p in enumerate(s.inputs[0]):
            if isinstance(p, Shard) and p.dim == 1:
                # the vocabulary-split loss waits on each of its three reductions
                total += 3 * blocking_time("all_reduce", self.mesh, a, rows * 4.0)
        return total

    def split_reduction_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """A 2-norm or variance over a split dim (:mod:`autopar.runtime.reductions`):
        per splitting axis, its all-reduces of output-sized sums in the forward, and as
        many of their gradients in the backward."""
        axes = split_axes(node, s.inputs[0])
        if not axes:
            return 0.0
        out = info(node).outputs[0]
        nbytes = self._local_bytes_of(out, s.outputs[0])
        rounds = split_all_reduces(node) * (2 if info(node).backward else 1)
        return rounds * sum(blocking_time("all_reduce", self.mesh, a, nbytes) for a in axes)

    def _local_bytes_of(self, t: TensorInfo, p: Placements) -> float:
        return math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))
    def batch_norm_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step of a training batch norm's own all-reduces
        (:mod:`autopar.runtime.norms`): per mesh axis splitting the batch or a spatial
        dim, the per-channel sums and squared deviations in the forward and their
        gradients in the backward; with the channels split and running statistics, one
        of each running statistic over the channel axes."""
        if not batch_norm_training(node):
            return 0.0
        stat, chan = batch_norm_axes(s.inputs[0])
        x = info(node.args[0]).out
        item = x.nbytes / max(x.numel, 1)
        per_channel = local_shape(x.shape, s.inputs[0], self.mesh.shape)[1] * item
        t = 4 * sum(blocking_time("all_reduce", self.mesh, (a,), per_channel) for a in stat)
        if chan and len(tensor_inputs(node)) == 5:  # running mean and variance, whole
            t += 2 * blocking_time("all_reduce", self.mesh, chan, x.shape[1] * item)
        return t

    def _local_bytes(self, x: fx.Node, p: Placements) -> float:
        t = info(x).out
        return math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))

    def _ring(self, node: fx.Node, axes: tuple[int, ...]) -> tuple[int, bool]:
        """Ring size and whether ring attention of ``node`` over ``axes`` runs zigzag
        balanced (causal, each rank's chunk halves: ``ring_balanced``)."""
        n = math.prod(self.mesh.shape[a] for a in axes)
        causal = sdpa_args(node).is_causal
        return n, causal and ring_balanced(info(node.args[0]).out.shape[2] // n)

    def attention_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step (forward + backward) of a context-parallel attention's own
        exchanges (:mod:`autopar.runtime.context`, :mod:`autopar.runtime.ring_attention`).

        Ulysses: per CP axis one all-to-all of q, k, v and the output in the forward,
        the reverse ones in the backward.  Ring: the busiest rank's point-to-point
        transfers of key/value blocks (``n - 1`` shifts, plus the zigzag re-layout when
        it runs), as many again for their gradients in the backward.
        """
        layout = context_layout(node, s.inputs, self.mesh.shape)
        if layout is None or layout.impl is None:
            return 0.0
        a = sdpa_args(node)
        qp, kp, vp, _ = sdpa_placements(node, s.inputs)
        q, k, v = (self._local_bytes(x, p) for x, p in ((a.q, qp), (a.k, kp), (a.v, vp)))
        o = self._local_bytes(node, s.outputs[0])
        if layout.impl is CPImpl.RING:
            n, balanced = self._ring(node, layout.cp_axes)
            _, transfers = ring_attention_cost_factors(n, a.is_causal, balanced)
            # the factor counts the zigzag re-layout in K/V blocks, true when q and the
            # output are as large as k and v; it moves half (2 ranks) or all of this
            # rank's q, k, v and output, so price it by their real sizes (GQA: q is larger)
            relayout = transfers - (n - 1)
            return 2.0 * ((n - 1) * send_recv_time(self.mesh, layout.cp_axes, k + v)
                          + relayout * send_recv_time(self.mesh, layout.cp_axes,
                                                      (q + k + v + o) / 2))
        return 2.0 * sum(blocking_time("all_to_all", self.mesh, ax, b)
                         for ax in layout.cp_axes for b in (q, k, v, o))

    def experts_comm(self, node: fx.Node, s: OpStrategy) -> float:
        """Seconds per step of an expert-parallel experts op's own exchanges
        (:func:`autopar.runtime.experts.expert_parallel`): per expert-parallel axis the
        routed rows (``T_local * k`` of ``H`` elements) go out and come back by two
        all-to-alls in the forward and two in the backward, plus the small exchanges of
        counts and expert ids.  Routing is assumed even: the all-to-alls are priced at
        the mean rows per rank; a skewed router makes the busiest rank send and compute
        more than this says (no capacity limit caps it).  Experts split with tokens
        whole exchange nothing here (their Partial output is priced on its edge)."""
        ep, _ = expert_axes(s.inputs)
        if not ep:
            return 0.0
        hidden, index = info(node.args[0]).out, info(node.args[1]).out
        loc_h = local_shape(hidden.shape, s.inputs[0], self.mesh.shape)
        loc_i = local_shape(index.shape, s.inputs[1], self.mesh.shape)
        pairs = loc_i[0] * loc_i[1]
        weights = info(node.args[3]).out  # rows travel in the experts' dtype
        rows = pairs * loc_h[-1] * weights.nbytes / max(weights.numel, 1)
        n = self.mesh.shape[ep[0]]
        return (4.0 * blocking_time("all_to_all", self.mesh, ep[0], rows)
                + blocking_time("all_to_all", self.mesh, ep[0], pairs * 8.0)
                + blocking_time("all_to_all", self.mesh, ep[0], n * 8.0))

    def attention_compute_factor(self, node: fx.Node, s: OpStrategy) -> float:
        """The slowest rank's attention work against an even split of the priced FLOPs.

        Every attention is priced at its whole score matrix, causal or not (a fused
        causal kernel skips about half, for every strategy alike).  So the ring is
        charged only for its imbalance, not credited with the future blocks it skips:
        zigzag-balanced or non-causal it is even (1.0); causal with contiguous chunks the
        last rank does ``(2n-1)/(2n^2)`` of the causal work where an even split does
        ``1/(2n)``, ``(2n-1)/n`` times more.  (Crediting the skip would favour ring
        attention, which runs slower than data parallel on gloo: docs/benchmarks.md,
        Context parallel.)  Causal query rows compute every block
        under an explicit mask: 2.0, twice a fused causal kernel's work."""
        layout = context_layout(node, s.inputs, self.mesh.shape)
        if layout is None or not sdpa_args(node).is_causal:
            return 1.0
        if layout.impl is None:
            # query rows: row_attention turns is_causal into an explicit mask, so every
            # score block is computed (and no fused causal kernel runs), twice what a
            # fused causal kernel does on the other splits
            return 2.0 if layout.row_axes else 1.0
        if layout.impl is not CPImpl.RING:
            return 1.0
        n, balanced = self._ring(node, layout.cp_axes)
        return 1.0 if balanced else (2 * n - 1) / n

    def grad_sync(self, p: Placements, t: TensorInfo) -> float:
        """All-reduce of a parameter's gradient over the axes it is replicated on."""
        axes = replicated_axes(p, self.mesh.shape)
        if not axes:
            return 0.0
        b = math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))
        # gradients are fused into buckets (runtime/grad_sync.py): the latency is paid
        # once per bucket, not per parameter, so a parameter pays only the bandwidth term
        return max(0.0, all_reduce_time(self.mesh, axes, b) - all_reduce_time(self.mesh, axes, 1.0))

    def node_memory(self, node: fx.Node, s: OpStrategy) -> float:
        """Bytes a strategy keeps per device: parameter + gradient + optimizer state
        for parameters; the output kept for backward for compute ops (none when only
        casts use it, :func:`feeds_only_casts`)."""
        ni = info(node)
        if node.op == "get_attr":
            if ni.param is None:
                return float(ni.out.nbytes)
            b = math.prod(local_shape(ni.out.shape, s.outputs[0], self.mesh.shape)) * (
                ni.out.nbytes / max(ni.out.numel, 1))
            return 2.0 * b + optimizer_state_bytes(b, self.optimizer)
        if node.op != "call_function" or node.target in VIEW_OPS or node.target is operator.getitem \
                or is_noop_cast(node):
            return 0.0  # a view or a no-op cast: its input's bytes, counted there
        if not ni.tuple_output and not kept_for_backward(node):
            return 0.0  # backward reads nothing of it: freed once its readers ran
        fused = self.fusion.of(node) if self.fusion is not None else None
        if fused is not None and fused.internal:
            return 0.0  # never in memory: the compiled backward recomputes it from the group's inputs
        total = 0.0
        for t, p in zip(ni.outputs, s.outputs):
            total += math.prod(local_shape(t.shape, p, self.mesh.shape)) * (t.nbytes / max(t.numel, 1))
        if node.target is aten.cross_entropy_loss.default:
            # cross-entropy keeps its log-probabilities (logits-sized) for backward
            x = info(node.args[0]).out
            total += math.prod(local_shape(x.shape, s.inputs[0], self.mesh.shape)) * (
                x.nbytes / max(x.numel, 1))
        return total


def param_state_split(node: fx.Node, p: Placements, mesh: MeshSpec, optimizer: str) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per device for a parameter placed ``p``."""
    t = info(node).out
    b = math.prod(local_shape(t.shape, p, mesh.shape)) * (t.nbytes / max(t.numel, 1))
    return b, b, optimizer_state_bytes(b, optimizer)


__all__ = ["SAVES_NO_INPUT", "CostModel", "in_memory", "kept_for_backward", "param_state_split",
           "precision_warning"]
