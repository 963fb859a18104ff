"""Per-layer time and memory of an intra-op plan: the inputs of the joint search over
pipeline stages, micro-batches, ZeRO and recomputation (:mod:`autopar.search.stages.pipeline_step`).

The intra-op plan is made for one micro-batch on one stage's sub-mesh; this module
reads it back per layer (:mod:`autopar.capture.layers`):

* ``seconds``: forward + backward time of one micro-batch (compute, the op's own
  collectives and the redistributions on its input edges, both directions);
* ``forward``: the forward share, which recomputation pays again in backward
  (compute / (1 + backward factor) + half the edge communication);
* ``activations``: bytes kept for backward per micro-batch (outputs of computing ops);
* ``out_bytes``: bytes of values leaving the layer (what a recomputed layer keeps);
  ``wire_bytes`` and ``wire_gather``: what a pipeline cut after it sends per rank (a
  replicated value as one slice per rank), and the all-gather of those slices and the
  reduce-scatter of their gradient where they arrive (:mod:`autopar.runtime.stage_wire`);
* parameters: local bytes, the part replicated on each sub-mesh axis (ZeRO candidates)
  and gradient-reduction prices.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.capture.ir import info, tensor_inputs
from autopar.capture.user_checkpoint import Coverage, coverage, region_of
from autopar.cost_models import (
    MeshSpec,
    all_reduce_time,
    blocking_time,
)
from autopar.plans.data import NodePlan, Plan
from autopar.plans.placement import local_shape, parse_placements, replicated_axes
from autopar.search.fusion import Fusion
from autopar.search.node_prices import compute_floor, kernel_terms
from autopar.sharding.rules.losses import count_axes


@dataclass
class ParamStat:
    """One parameter's local bytes and the mesh axes it is replicated on."""

    bytes: float
    replicated: tuple[int, ...]
    name: str = ""  # the parameter's graph target (what the runtime's buckets name)
    shape: tuple[int, ...] = ()
    """Its local shape (empty when unknown): PowerSGD's matrix view of its gradient."""

    @property
    def numel(self) -> int:
        """Local elements (0 when the shape is unknown)."""
        return math.prod(self.shape) if self.shape else 0


@dataclass
class LayerStat:
    """Time and memory of one layer for one micro-batch (see module docstring)."""

    key: str
    seconds: float = 0.0
    forward: float = 0.0
    compute: float = 0.0  # the compute share of ``seconds`` (the rest is communication)
    activations: float = 0.0
    largest: float = 0.0
    """Bytes of the largest single op's kept activations: the size of the gradients
    the layer's backward holds at once (a logits-sized one under a cross-entropy)."""
    out_bytes: float = 0.0
    wire_bytes: float = 0.0
    wire_gather: float = 0.0
    params: list[ParamStat] = field(default_factory=list)
    buffers: float = 0.0
    floor: float = 0.0
    """Device-seconds of forward + backward compute no placement goes below
    (:func:`autopar.search.node_prices.compute_floor` summed over the layer's ops)."""
    kernels: tuple[tuple[float, float, float], ...] = ()
    """Per op that launches a kernel, forward + backward on one device with whole tensors
    (:func:`autopar.search.node_prices.kernel_terms`): its compute-bound seconds, and the
    memory-bound seconds of what it reads from the weights (the same at any micro-batch
    size) and of the rest (at most proportional to it): :func:`kernel_floor`."""
    weight_grad_inputs: float = 0.0
    """Bytes of the outputs of ops that read a weight (through views and casts): the
    gradients a split backward keeps from ``B`` to ``W`` (the zero-bubble schedule)."""
    cast_param_bytes: float = 0.0
    """Local bytes of the parameters read only through dtype casts (mixed precision):
    backward keeps their low-precision copy (an activation), so ZeRO-3 does not
    re-gather them."""
    comm_latency: float = 0.0
    """Seconds of the layer's blocking collectives (one each way, forward and backward,
    on the mesh's dearest axis) that do not grow with their bytes: what twin
    collectives in flight at once share (``MeshSpec.collective_pairing``)."""
    comm_drift: float = 0.0
    """Seconds the layer's blocking collectives (its redistributions, forward and
    backward) wait for the ranks' drift (``mesh.sync_seconds`` each): two copies' twin
    collectives wait it out once (:func:`autopar.search.stages.step_terms.copies_hidden`)."""
    behind: float = 0.0
    """Seconds of collectives the layer leaves in flight beside the forward: the
    cross-entropy's token count (:func:`autopar.sharding.rules.losses.count_axes`), which the
    intra-op plan prices hidden and the stage exposes as far as the forward cannot
    hide it (:func:`autopar.search.stages.price.price_stage`)."""
    checkpointed: Coverage = Coverage.NONE
    """How much of the layer the model's own activation checkpointing covers
    (:mod:`autopar.capture.user_checkpoint`): a covered layer is always recomputed."""
    updates_state: bool = False
    """The layer's forward updates state in place (a training batch norm's running
    statistics and step count): recomputing it would update that state twice, and
    checkpoint's replay refuses the in-place write, so it is never recomputed."""

    @property
    def param_bytes(self) -> float:
        """Local parameter bytes (before ZeRO)."""
        return sum(p.bytes for p in self.params)


def _local_bytes(node: fx.Node, placement: str, mesh: MeshSpec) -> float:
    t = info(node).out
    return math.prod(local_shape(t.shape, parse_placements(placement), mesh.shape)) * (
        t.nbytes / max(t.numel, 1))


def _latency(mesh: MeshSpec) -> float:
    """One all-reduce's price at one byte on the mesh's dearest axis (its latencies)."""
    return max((all_reduce_time(mesh, (a,), 1.0) for a, n in enumerate(mesh.shape) if n > 1),
               default=0.0)


def layer_stats(gm: fx.GraphModule, plan: Plan, backward_factor: float = 2.0,
                fusion: Fusion | None = None) -> list[LayerStat]:
    """Per-layer statistics of ``plan`` (made for ``gm``, compiled as ``fusion`` fuses
    it, :func:`autopar.search.fusion.fuse`; None: eager), in layer order."""
    mesh = plan.mesh
    # what one blocking collective each way waits for the drift and pays in latency
    # (the same for every node: priced once, not per node of every candidate plan)
    blocking = (2.0 * mesh.sync_seconds, 2.0 * _latency(mesh) if mesh.collective_pairing > 0 else 0.0)
    stats: dict[str, LayerStat] = {}
    order: list[str] = []
    layer_of: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        np_ = plan.nodes.get(n.name)
        if np_ is None:
            continue
        key = np_.layer or "post"
        layer_of[n] = key
        if key not in stats:
            stats[key] = LayerStat(key)
            order.append(key)
        _add_node(stats[key], n, np_, mesh, blocking, backward_factor)
    _add_weight_reads(stats, layer_of, plan, backward_factor, fusion)
    _mark_checkpointed_and_stateful(stats, layer_of, plan)
    # bytes leaving each layer: values used by a later layer (each value once)
    for n, key in layer_of.items():
        if n.op in ("placeholder", "get_attr") or n.target is operator.getitem:
            continue
        if any(layer_of.get(u, key) != key for u in n.users if u.op != "output") \
                and info(n).outputs and not info(n).tuple_output:
            _add_out(stats[key], n, plan.nodes[n.name].out_placements[0], mesh)
    # the loss is always "post": keep pre/post at the ends even if graph order differs
    keys = [k for k in order if k == "pre"] + [k for k in order if k not in ("pre", "post")] + \
        [k for k in order if k == "post"]
    return [stats[k] for k in keys]


def _add_out(st: LayerStat, n: fx.Node, placement: str, mesh: MeshSpec) -> None:
    """Add value ``n`` (in ``placement``), leaving the layer, to its bytes and to what a
    pipeline cut after the layer sends and gathers (sliced over the axes it is
    replicated on, as :mod:`autopar.runtime.stage_wire` sends it)."""
    nbytes = _local_bytes(n, placement, mesh)
    st.out_bytes += nbytes
    axes = replicated_axes(parse_placements(placement), mesh.shape)
    st.wire_bytes += nbytes / math.prod(mesh.shape[a] for a in axes)
    if axes:  # the receiving stage gathers it in forward, reduce-scatters its gradient
        st.wire_gather += blocking_time("all_gather", mesh, axes, nbytes) \
            + blocking_time("reduce_scatter", mesh, axes, nbytes)


def _add_node(st: LayerStat, n: fx.Node, np_: NodePlan, mesh: MeshSpec, blocking: tuple[float, float],
              backward_factor: float) -> None:
    """Add node ``n`` (planned as ``np_``) to its layer's statistics: a parameter's bytes
    and where it is replicated, a buffer's bytes, an op's time and memory.  ``blocking``:
    what one blocking collective each way waits for the drift and pays in latency."""
    if np_.kind == "param":
        pl = parse_placements(np_.out_placements[0])
        rep = replicated_axes(pl, mesh.shape)
        nbytes = _local_bytes(n, np_.out_placements[0], mesh)
        shape = tuple(local_shape(info(n).out.shape, pl, mesh.shape))
        st.params.append(ParamStat(nbytes, rep, np_.param or n.name, shape))
        if n.users and all(u.op == "call_function" and u.target is torch.ops.aten._to_copy.default
                           for u in n.users):
            st.cast_param_bytes += nbytes
    elif np_.kind == "buffer":
        st.buffers += np_.memory
    elif np_.kind == "op":
        st.seconds += np_.compute + np_.comm
        st.compute += np_.compute
        if np_.comm > 0:
            # one blocking collective each way (the search's candidates carry no
            # per-edge steps to count): a tensor-parallel all-reduce, gather or scatter
            st.comm_drift += min(np_.comm, blocking[0])
            st.comm_latency += min(np_.comm, blocking[1])
        st.forward += np_.compute / (1.0 + backward_factor) + np_.comm / 2.0
        st.activations += np_.memory
        st.largest = max(st.largest, np_.memory)
        st.floor += compute_floor(n, mesh, backward_factor)
        # only a cross-entropy sums a count: parse no other op's placements (every
        # node of every candidate plan passes here)
        if n.target is torch.ops.aten.cross_entropy_loss.default and np_.in_placements:
            count = count_axes(n, parse_placements(np_.in_placements[0]), mesh.shape)
            if count:
                st.behind += all_reduce_time(mesh, count, 8.0)  # int64 count


def _add_weight_reads(stats: dict[str, LayerStat], layer_of: dict[fx.Node, str], plan: Plan,
                      backward_factor: float, fusion: Fusion | None = None) -> None:
    """Each layer's ``weight_grad_inputs`` and ``kernels``: the ops that read a weight
    (through single-input views and casts of it) and each kernel's weight bytes; the
    ops of one fused group (a layer's, under ``fusion``) as one kernel."""
    mesh = plan.mesh
    from_weight: set[fx.Node] = set()
    kernels: dict[str, list[tuple[float, float, float]]] = {}
    group_at: dict[tuple[str, int], int] = {}  # (layer, fused group) -> its kernel's index
    for n in layer_of:
        np_ = plan.nodes[n.name]
        ins = n.all_input_nodes
        if np_.kind == "param" or (np_.kind == "op" and len(ins) == 1 and ins[0] in from_weight):
            from_weight.add(n)
        elif np_.kind == "op" and any(a in from_weight for a in ins) and info(n).outputs \
                and not info(n).tuple_output:
            stats[layer_of[n]].weight_grad_inputs += _local_bytes(n, np_.out_placements[0], mesh)
        terms = kernel_terms(n, mesh, backward_factor, fusion) if np_.kind == "op" else None
        if terms is not None:
            flops, sizes = terms
            if n in from_weight:  # a cast or view of a weight: all of it is the weight's
                weight = sum(sizes)
            else:
                weight = sum(b for u, b in zip(tensor_inputs(n), sizes) if u in from_weight)
            ks = kernels.setdefault(layer_of[n], [])
            fused = fusion.of(n) if fusion is not None else None
            at = (layer_of[n], fused.group) if fused is not None else None
            if at in group_at:  # one launch for the group
                f0, w0, a0 = ks[group_at[at]]
                ks[group_at[at]] = (f0 + flops, w0 + weight, a0 + sum(sizes) - weight)
                continue
            if at is not None:
                group_at[at] = len(ks)
            ks.append((flops, weight, sum(sizes) - weight))
    for key, ks in kernels.items():
        stats[key].kernels = tuple(ks)


def updates_state(n: fx.Node) -> bool:
    """Whether op ``n`` writes state in place: a mutating overload (the step count's
    ``add_``) or a batch norm in training with running statistics."""
    if n.op != "call_function":
        return False
    if n.target is torch.ops.aten.batch_norm.default:
        training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", True)
        running = n.args[3] if len(n.args) > 3 else n.kwargs.get("running_mean")
        return bool(training) and running is not None
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _mark_checkpointed_and_stateful(stats: dict[str, LayerStat], layer_of: dict[fx.Node, str],
                                    plan: Plan) -> None:
    """Each layer's :attr:`LayerStat.checkpointed`, from how many of its ops ran in one
    of the model's own checkpoint regions, and its :attr:`LayerStat.updates_state`."""
    ops: dict[str, list[int]] = {}
    for n, key in layer_of.items():
        if plan.nodes[n.name].kind == "op":
            stats[key].updates_state |= updates_state(n)
            counts = ops.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += region_of(n) is not None
    for key, (total, marked) in ops.items():
        stats[key].checkpointed = coverage(total, marked)


def kernel_floor(stats: list[LayerStat], mesh: MeshSpec, devices: int, flop_scale: float,
                 act_scale: float, backward_factor: float = 2.0) -> list[float]:
    """Per layer, seconds per micro-batch no placement on ``devices`` devices goes below,
    the layers captured at another micro-batch size: FLOPs scaled by ``flop_scale``
    (linear in the batch), bytes not read from a weight by ``act_scale`` (at most
    that: some tensors have no batch dim), weight bytes as they are.  Each op takes
    the largest of its compute-bound time, its memory-bound time (each at most divided
    by ``devices``) and the launch floor, as :func:`~autopar.cost_models.compute_time`
    prices it (times the straggler), so many micro-batches of small ops cost at least
    their launches.  Layers sharing their op list (blocks extrapolated from one) are
    summed once."""
    launch = mesh.kernel_floor * (1.0 + backward_factor)
    seen: dict[int, float] = {}
    out = []
    for st in stats:
        t = seen.get(id(st.kernels))
        if t is None:
            t = mesh.straggler * sum(max(f * flop_scale / devices, (w + a * act_scale) / devices, launch)
                                     for f, w, a in st.kernels)
            seen[id(st.kernels)] = t
        out.append(t)
    return out


__all__ = ["LayerStat", "ParamStat", "kernel_floor", "layer_stats", "updates_state"]
