"""Annotate pass: shapes, dtypes, FLOPs and bytes moved on every node.

Before: a captured graph whose nodes carry ``meta["val"]`` (fake tensors from export).
After: every node has a :class:`~autopar.capture.ir.NodeInfo` in ``meta["autopar"]``.
Example: ``aten.linear(x[8,32,64], w[256,64])`` gets ``outputs=(TensorInfo((8,32,256)),)``
and ``flops = 2*8*32*64*256``.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from autopar.capture.grad_flow import mark_gradients
from autopar.capture.ir import META_KEY, NodeInfo, TensorInfo

aten = torch.ops.aten

# Ops that only reinterpret memory: no FLOPs and no bytes moved.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.alias.default,
    aten.flatten.using_ints, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.slice.Tensor, aten.select.int, aten.unbind.int,
    aten.detach.default, aten.contiguous.default,
}


# Casts that return their input unchanged when nothing changes (torch's ``Tensor.to``).
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device}


def is_noop_cast(node: fx.Node) -> bool:
    """Whether ``node`` is a ``Tensor.to`` that returns its input itself: the dtype and
    device it asks for are the input's and it does not ask for a copy (an fp32 model's
    ``hidden.to(torch.float32)``, which HF's RMSNorm writes twice per norm).  It launches
    nothing: the 14 of a 2-layer Llama took 14 us a step in all, priced 0.8 ms as copies."""
    if node.op != "call_function" or node.target not in CASTS or not node.args:
        return False

    def arg(name: str):
        for i, a in enumerate(node.target._schema.arguments):
            if a.name == name:
                return node.args[i] if i < len(node.args) else node.kwargs.get(name)
        return None
    if arg("copy"):
        return False
    src, out = getattr(node.args[0], "meta", {}).get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    fmt = arg("memory_format")
    return (src.dtype == out.dtype and src.device == out.device and src.layout == out.layout
            and (fmt is None or fmt == torch.preserve_format))


def _tensor_infos(val: object) -> tuple[tuple[TensorInfo, ...], bool]:
    if isinstance(val, torch.Tensor):
        return (TensorInfo(tuple(int(s) for s in val.shape), val.dtype),), False
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return tuple(TensorInfo(tuple(int(s) for s in v.shape), v.dtype) for v in val), True
    return (), False


def _numel(n: object) -> int:
    if isinstance(n, fx.Node) and META_KEY in n.meta and n.meta[META_KEY].outputs:
        return sum(t.numel for t in n.meta[META_KEY].outputs)
    return 0


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> float:
    """A multiply-add per point of the letters' product space per extra operand (2 for
    ``egcm,emh->egch``: 2*E*G*C*M*H, the batched matmul it runs).  An ellipsis counts
    as one letter of the largest size it stands for in any operand."""
    sizes: dict[str, int] = {}
    for spec, sh in zip(equation.replace(" ", "").split("->")[0].split(","), shapes):
        head, dots, tail = spec.partition("...")
        named = [*zip(head, sh[:len(head)]), *zip(tail, sh[len(sh) - len(tail):])]
        if dots:  # the dims between the named head and tail
            named.append(("...", math.prod(sh[len(head):len(sh) - len(tail)])))
        for c, n in named:
            sizes[c] = max(sizes.get(c, 1), n)
    return 2.0 * (len(shapes) - 1) * math.prod(sizes.values())


def op_flops(node: fx.Node) -> float:
    """Forward FLOPs of one node (multiply-add counted as 2)."""
    t = node.target
    outs = node.meta[META_KEY].outputs
    if not outs:
        return 0.0
    out_numel = outs[0].numel
    a = node.args
    def shape(x: fx.Node) -> tuple[int, ...]:
        return x.meta[META_KEY].outputs[0].shape
    if t in (aten.linear.default,):
        return 2.0 * out_numel * shape(a[1])[-1]
    if t in (aten.addmm.default,):
        return 2.0 * out_numel * shape(a[1])[-1]
    if t in (aten.mm.default, aten.bmm.default, aten.matmul.default):
        return 2.0 * out_numel * shape(a[0])[-1]
    if t is aten.einsum.default and len(a[1]) >= 2:
        return _einsum_flops(str(a[0]), [shape(x) for x in a[1]])
    if t is aten.scaled_dot_product_attention.default:
        b_h_t_d = shape(a[0])
        s = shape(a[1])[-2]
        return 4.0 * math.prod(b_h_t_d) * s
    if str(t) == "autopar.moe_experts.default":
        # routed experts: every token's k experts, gate+up [2I, H] and down [H, I]
        tk, hd, inter = shape(a[1])[0] * shape(a[1])[1], shape(a[0])[-1], shape(a[4])[-1]
        return 2.0 * tk * 3 * hd * inter
    if t in (aten.conv2d.default, aten.convolution.default):
        w = shape(a[1])
        return 2.0 * out_numel * math.prod(w[1:])
    if t in VIEW_OPS or t is operator.getitem or t is aten.embedding.default:
        return 0.0
    # Pointwise, norms, reductions, losses: a handful of FLOPs per input element.
    return float(max(out_numel, sum(_numel(x) for x in node.all_input_nodes)))


def annotate(gm: fx.GraphModule) -> fx.GraphModule:
    """Write a :class:`NodeInfo` into every node of ``gm`` (see module docstring)."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:
        if node.op == "output":
            node.meta[META_KEY] = NodeInfo()
            continue
        val = node.meta.get("val")
        if val is None and node.op == "get_attr":
            val = gm.get_submodule("").get_parameter(node.target) if node.target in params else None
        outs, is_tuple = _tensor_infos(val)
        ni = NodeInfo(outputs=outs, tuple_output=is_tuple)
        if node.op == "get_attr":
            ni.param = node.target if node.target in params else None
            ni.buffer = node.target if node.target in buffers else None
        node.meta[META_KEY] = ni
        if node.op == "call_function" and is_noop_cast(node):
            pass  # no FLOPs, no bytes: like a view
        elif node.op == "call_function":
            ni.flops = op_flops(node)
            if node.target not in VIEW_OPS and node.target is not operator.getitem:
                in_bytes = sum(
                    sum(t.nbytes for t in x.meta[META_KEY].outputs)
                    for x in node.all_input_nodes if META_KEY in x.meta
                )
                ni.bytes_moved = float(in_bytes + sum(t.nbytes for t in outs))
    mark_gradients(gm)  # it reads the NodeInfos written above
    return gm
