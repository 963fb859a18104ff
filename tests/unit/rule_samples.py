"""The validator's hand-written samples, part one (matmul, pointwise, norms, views),
and the helpers that declare them: each ``cap``/``direct`` call appends a
:class:`Sample` to :data:`SAMPLES`, which ``test_rules.py`` runs."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tagged_samples import sample_call, tagged_ops
from torch import fx, nn

from autopar.capture.annotate import annotate
from autopar.capture.trace import capture

aten = torch.ops.aten
F64 = torch.float64
MESHES = ((2,), (2, 2))
WITH_4 = ((2,), (2, 2), (4,))


# ---------------------------------------------------------------- input specs
@dataclass(frozen=True)
class T:
    """An input tensor: ``kind`` n (normal), p (positive), b (bool), i (ints < high),
    u (uniform in 0.1..0.9), g (uniform in 1.1..2.1)."""

    kind: str
    shape: tuple[int, ...]
    high: int = 0

    def make(self, gen: torch.Generator) -> torch.Tensor:
        if self.kind == "n":
            return torch.randn(self.shape, dtype=F64, generator=gen)
        if self.kind == "p":
            return torch.rand(self.shape, dtype=F64, generator=gen) + 0.5
        if self.kind in ("u", "g"):
            lo = 0.1 if self.kind == "u" else 1.1
            return torch.rand(self.shape, dtype=F64, generator=gen) * 0.8 + lo
        if self.kind == "b":
            return torch.rand(self.shape, generator=gen) > 0.5
        return torch.randint(0, self.high, self.shape, generator=gen)


def N(*s: int) -> T:
    return T("n", s)


def Pos(*s: int) -> T:
    return T("p", s)


def B(*s: int) -> T:
    return T("b", s)


def Ints(high: int, *s: int) -> T:
    return T("i", s, high)


@dataclass(frozen=True)
class Arg:
    """Placeholder ``i`` inside a direct sample's argument list."""

    i: int


class Fn(nn.Module):
    """``forward(*xs) = f(self, *xs)``; submodules given as keywords."""

    def __init__(self, f: Callable, **mods: nn.Module) -> None:
        super().__init__()
        self.f = f
        for k, m in mods.items():
            setattr(self, k, m)

    def forward(self, *xs: torch.Tensor) -> object:
        return self.f(self, *xs)


@dataclass(frozen=True)
class Sample:
    """One validator case: ``build(gen) -> (annotated graph, flat inputs)``."""

    name: str
    build: Callable[[torch.Generator], tuple[fx.GraphModule, list[torch.Tensor]]]
    meshes: tuple[tuple[int, ...], ...] = MESHES
    shape_only: bool = False


SAMPLES: list[Sample] = []


def cap(name: str, f: Callable, *specs: T, meshes=MESHES, fix: Callable | None = None,
        **mods: nn.Module) -> None:
    """A captured sample: ``f(self, *inputs)``; ``fix`` edits the inputs (e.g. ignore_index)."""
    def build(gen):
        xs = [s.make(gen) for s in specs]
        if fix is not None:
            fix(xs)
        model = Fn(f, **mods).double()
        with torch.no_grad():
            for prm in model.parameters():
                prm.copy_(torch.randn(prm.shape, dtype=F64, generator=gen))
        gm = annotate(capture(model, tuple(xs)).gm)
        return gm, xs
    SAMPLES.append(Sample(name, build, meshes))


def direct(name: str, op: object, specs: list[T], *args: object, meshes=MESHES,
           shape_only: bool = False, **kwargs: object) -> None:
    """A hand-built single-op graph ``op(*args, **kwargs)``; ``Arg(i)`` is input ``i``."""
    def build(gen):
        xs = [s.make(gen) for s in specs]
        g = fx.Graph()
        phs = _placeholders(g, xs)

        def sub(a, vals):
            if isinstance(a, Arg):
                return vals[a.i]
            if isinstance(a, (list, tuple)):
                return type(a)(sub(b, vals) for b in a)
            return a
        n = g.call_function(op, sub(args, phs), {k: sub(v, phs) for k, v in kwargs.items()})
        n.meta["val"] = op(*sub(args, xs), **{k: sub(v, xs) for k, v in kwargs.items()})
        g.output(n)
        return annotate(fx.GraphModule(nn.Module(), g)), xs
    SAMPLES.append(Sample(name, build, meshes, shape_only))


def _ignore(idx: int, value: int) -> Callable:
    def fix(xs):
        xs[idx][::3] = value  # every third target ignored
    return fix


x0, x1, x2, x3 = Arg(0), Arg(1), Arg(2), Arg(3)

# ---------------------------------------------------------------- matmul family
cap("linear_bias_2d", lambda m, x: m.l(x), N(4, 8), l=nn.Linear(8, 6), meshes=WITH_4)
cap("linear_nobias_3d", lambda m, x: m.l(x), N(2, 4, 8), l=nn.Linear(8, 4, bias=False))
cap("linear_bias_3d", lambda m, x: m.l(x), N(2, 4, 8), l=nn.Linear(8, 4))
cap("addmm_bias1d", lambda m, b, x, w: torch.addmm(b, x, w), N(6), N(4, 8), N(8, 6))
cap("addmm_bias2d", lambda m, b, x, w: torch.addmm(b, x, w), N(4, 6), N(4, 8), N(8, 6))
direct("addmm_beta2", aten.addmm.default, [N(6), N(4, 8), N(8, 6)], x0, x1, x2, beta=2, alpha=3)
cap("mm", lambda m, x, w: torch.mm(x, w), N(4, 8), N(8, 6), meshes=WITH_4)
cap("mm_self", lambda m, x: torch.mm(x, x), N(4, 4))
cap("bmm", lambda m, x, w: torch.bmm(x, w), N(2, 4, 8), N(2, 8, 6))
cap("matmul_batched", lambda m, x, w: x @ w.transpose(-1, -2), N(2, 4, 8), N(2, 6, 8))
cap("matmul_2d_rhs", lambda m, x, w: x @ w, N(2, 4, 8), N(8, 6))
# baddbmm: a split k leaves the product Partial, and the input Partial beside it (beta
# times each summand adds up to beta times the input); broadcast input dims stay whole
direct("baddbmm", aten.baddbmm.default, [N(4, 4, 6), N(4, 4, 8), N(4, 8, 6)], x0, x1, x2,
       meshes=WITH_4)
direct("baddbmm_beta_alpha", aten.baddbmm.default, [N(6), N(4, 4, 8), N(4, 8, 6)], x0, x1, x2,
       beta=2.0, alpha=0.5, meshes=WITH_4)
direct("baddbmm_broadcast", aten.baddbmm.default, [N(4, 1, 6), N(4, 4, 8), N(4, 8, 6)],
       x0, x1, x2, beta=3)
direct("baddbmm_beta0", aten.baddbmm.default, [N(1, 4, 1), N(4, 4, 8), N(4, 8, 6)], x0, x1, x2,
       beta=0.0)
direct("matmul_broadcast_batch", aten.matmul.default, [N(2, 4, 8), N(1, 8, 6)], x0, x1)

# ---------------------------------------------------------------- pointwise family
cap("add_broadcast", lambda m, x, y: x + y, N(2, 4, 6), N(4, 1))
cap("add_same", lambda m, x: x + x, N(4, 6))
cap("sub_broadcast", lambda m, x, y: x - y, N(4, 6), N(6))
cap("mul_broadcast", lambda m, x, y: x * y, N(2, 4, 6), N(1, 6))
cap("mul_self", lambda m, x: x * x, N(4, 6))
cap("div_broadcast", lambda m, x, y: x / y, N(4, 6), Pos(4, 1))
cap("div_self", lambda m, x: x / x, Pos(4, 6))
cap("scalar_ops", lambda m, x: (x + 2.0, x - 1.5, x * 3.0, x / 4.0, 2.0 - x, 1.0 / x), Pos(4, 6))
cap("activations", lambda m, x: (torch.relu(x), F.gelu(x), torch.tanh(x),
                                 F.dropout(x, 0.0, True)), N(4, 6))
for _op, _spec, _extra in [
    (aten.silu.default, N, ()), (aten.sigmoid.default, N, ()), (aten.exp.default, N, ()),
    (aten.log.default, Pos, ()), (aten.sqrt.default, Pos, ()), (aten.rsqrt.default, Pos, ()),
    (aten.pow.Tensor_Scalar, N, (2,)), (aten.abs.default, N, ()), (aten.sin.default, N, ()),
    (aten.cos.default, N, ()), (aten.erf.default, N, ()), (aten.reciprocal.default, Pos, ()),
    (aten.hardtanh.default, N, ()), (aten.leaky_relu.default, N, ()),
    (aten.elu.default, N, ()), (aten.softplus.default, N, ()), (aten.ne.Scalar, Ints, (1,)),
    (aten.eq.Scalar, Ints, (1,)), (aten.lt.Scalar, N, (0.1,)), (aten.gt.Scalar, N, (0.1,)),
    (aten.le.Scalar, Ints, (1,)), (aten.ge.Scalar, Ints, (1,)), (aten.clamp.default, N, (-0.5, 0.5)),
    (aten.zeros_like.default, N, ()), (aten.ones_like.default, N, ()),
    (aten.full_like.default, N, (3.0,)), (aten.triu.default, N, ()), (aten.tril.default, N, (1,)),
    (aten.neg.default, N, ()), (aten.clone.default, N, ()), (aten.alias.default, N, ()),
    (aten.detach.default, N, ()), (aten.contiguous.default, N, ()),
    (aten.lift_fresh_copy.default, N, ()), (aten.to.dtype, N, (torch.float32,)),
    (aten.native_dropout.default, N, (0.0, True)), (aten.dropout.default, N, (0.0, True)),
]:
    _shape = (3, 2, 4, 4) if _spec is Ints else (2, 4, 4)
    _in = Ints(3, *_shape) if _spec is Ints else _spec(*_shape)
    direct(str(_op), _op, [_in], x0, *_extra)
direct("empty_like", aten.empty_like.default, [N(4, 6)], x0, shape_only=True)
direct("logical_not", aten.logical_not.default, [B(4, 6)], x0)
direct("bitwise_not", aten.bitwise_not.default, [B(4, 6)], x0)
direct("to_dtype_layout", aten.to.dtype_layout, [N(4, 6)], x0, dtype=torch.float32)
direct("to_device", aten.to.device, [N(4, 6)], x0, torch.device("cpu"), torch.float32)
direct("_to_copy_f32", aten._to_copy.default, [N(4, 6)], x0, dtype=torch.float32)
direct("type_as", aten.type_as.default, [N(4, 6), N(2)], x0, x1)
# casts to an integer dtype truncate each Partial piece: no Partial through them (issue
# 64, cause 1); an integer cast of integers, or to a float, stays linear
direct("_to_copy_int", aten._to_copy.default, [N(4, 6)], x0, dtype=torch.int64)
direct("to_dtype_int8", aten.to.dtype, [N(4, 6)], x0, torch.int8)
direct("to_dtype_bool", aten.to.dtype, [N(4, 6)], x0, torch.bool)
direct("type_as_int", aten.type_as.default, [N(4, 6), Ints(3, 2)], x0, x1)
direct("_to_copy_int_to_float", aten._to_copy.default, [Ints(5, 4, 6)], x0, dtype=F64)
# booleans have no sum: add/mul of booleans (or, and) never Partial
direct("add_bool", aten.add.Tensor, [B(4, 6), B(4, 6)], x0, x1)
direct("mul_bool", aten.mul.Tensor, [B(4, 6), B(6)], x0, x1)
direct("masked_fill_scalar", aten.masked_fill.Scalar, [N(2, 4, 4), B(4, 4)], x0, x1, -1.0)
direct("masked_fill_tensor", aten.masked_fill.Tensor, [N(2, 4, 4), B(4, 1), N()], x0, x1, x2)
for _op, _a, _b in [
    (aten.maximum.default, N(2, 4, 6), N(4, 1)), (aten.minimum.default, N(4, 6), N(6)),
    (aten.eq.Tensor, Ints(3, 4, 6), Ints(3, 6)), (aten.ne.Tensor, Ints(3, 4, 6), Ints(3, 4, 6)),
    (aten.lt.Tensor, N(4, 6), N(4, 1)), (aten.gt.Tensor, N(4, 6), N(4, 6)),
    (aten.le.Tensor, N(4, 6), N(6)), (aten.ge.Tensor, N(2, 4, 6), N(4, 6)),
    (aten.__and__.Tensor, B(4, 6), B(6)), (aten.__or__.Tensor, B(4, 6), B(4, 1)),
    (aten.bitwise_and.Tensor, B(4, 6), B(4, 6)), (aten.bitwise_or.Tensor, B(4, 6), B(6)),
    (aten.logical_and.default, B(4, 6), B(4, 6)), (aten.logical_or.default, B(4, 6), B(4, 1)),
    (aten.pow.Tensor_Tensor, Pos(4, 6), N(6)), (aten.atan2.default, N(4, 6), N(4, 6)),
    (aten.gelu_backward.default, N(4, 6), N(4, 6)), (aten.add.Tensor, N(4, 6), N(4, 6)),
    (aten.sub.Tensor, N(4, 6), N(1, 6)), (aten.mul.Tensor, N(4, 6), N(4, 6)),
    (aten.div.Tensor, N(4, 6), Pos(6)), (operator.add, N(4, 6), N(6)),
    (operator.sub, N(4, 6), N(4, 6)), (operator.mul, N(4, 6), N(4, 1)),
    (operator.truediv, N(4, 6), Pos(4, 6)),
]:
    direct(f"{_op}", _op, [_a, _b], x0, x1)
direct("add_alpha", aten.add.Tensor, [N(4, 6), N(4, 6)], x0, x1, alpha=2)
direct("threshold_backward", aten.threshold_backward.default, [N(4, 6), N(4, 6)], x0, x1, 0.0)
direct("where", aten.where.self, [B(4, 1), N(4, 6), N(6)], x0, x1, x2)
direct("add_scalar", aten.add.Scalar, [N(4, 6)], x0, 2.0)
direct("sub_scalar", aten.sub.Scalar, [N(4, 6)], x0, 2.0)
direct("rsub_scalar", aten.rsub.Scalar, [N(4, 6)], x0, 2.0)
direct("mul_scalar", aten.mul.Scalar, [N(4, 6)], x0, 3.0)
direct("div_scalar", aten.div.Scalar, [N(4, 6)], x0, 3.0)
direct("broadcast_tensors", aten.broadcast_tensors.default, [N(4, 6), N(6), N(4, 1)], [x0, x1, x2])

# every op the tag registers (autopar/sharding/rules/tagged.py), arguments off its schema
for _op in tagged_ops():
    _specs, _args, _kw = sample_call(_op, T, lambda i: Arg(i))
    direct(f"tagged-{_op}", _op, _specs, *_args, **_kw)
direct("hardswish_3d", aten.hardswish.default, [N(2, 4, 6)], x0, meshes=WITH_4)
direct("mish_3d", aten.mish.default, [N(2, 4, 6)], x0, meshes=WITH_4)
direct("clamp_tensor", aten.clamp.Tensor, [N(2, 4, 6), N(6), N(4, 1)], x0, x1, x2, meshes=WITH_4)
direct("clamp_tensor_max", aten.clamp.Tensor, [N(4, 6), N()], x0, None, x1)
direct("clamp_min", aten.clamp_min.default, [N(4, 6)], x0, 0.1, meshes=WITH_4)
direct("clamp_max_tensor", aten.clamp_max.Tensor, [N(4, 6), N(4, 6)], x0, x1)
direct("div_trunc", aten.div.Tensor_mode, [N(4, 8), N(8)], x0, x1, rounding_mode="trunc",
       meshes=WITH_4)
cap("normalize", lambda m, x: F.normalize(x, dim=-1), N(4, 2, 6), meshes=WITH_4)

# ---------------------------------------------------------------- norms and softmax
cap("layer_norm", lambda m, x: m.ln(x), N(2, 4, 8), ln=nn.LayerNorm(8))
cap("layer_norm_2d", lambda m, x: m.ln(x), N(2, 4, 8), ln=nn.LayerNorm([4, 8]))
cap("rms_norm", lambda m, x, w: F.rms_norm(x, (8,), w, 1e-6), N(2, 4, 8), N(8))


def _stats(bn: nn.Module) -> nn.Module:
    """``bn`` with running statistics that are not the defaults (eval reads them)."""
    gen = torch.Generator().manual_seed(7)
    bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=gen))
    bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=gen) + 0.5)
    return bn


cap("batch_norm2d_train", lambda m, x: m.bn(x), N(4, 4, 2, 4), bn=nn.BatchNorm2d(4),
    meshes=WITH_4)
cap("batch_norm2d_eval", lambda m, x: m.bn(x), N(4, 4, 2, 4), bn=_stats(nn.BatchNorm2d(4)).eval(),
    meshes=WITH_4)
cap("batch_norm1d_train", lambda m, x, y: (m.bn(x), m.bn(y)), N(4, 4), N(4, 4, 6),
    bn=nn.BatchNorm1d(4, momentum=0.3))
cap("batch_norm1d_eval", lambda m, x, y: (m.bn(x), m.bn(y)), N(4, 4), N(4, 4, 6),
    bn=_stats(nn.BatchNorm1d(4, affine=False)).eval())
direct("batch_norm_1d_input", aten.batch_norm.default, [N(0), N(0), N(0)], x0, None, None, x1, x2,
       True, 0.1, 1e-5, False)
cap("batch_norm_no_stats", lambda m, x: m.bn(x), N(4, 4, 2, 2),
    bn=nn.BatchNorm2d(4, track_running_stats=False))
cap("group_norm", lambda m, x, y: (m.gn(x), F.group_norm(y, 4, eps=1e-3)), N(2, 4, 3, 4),
    N(4, 8, 6), gn=nn.GroupNorm(2, 4), meshes=WITH_4)
cap("group_norm_2d", lambda m, x: m.gn(x), N(4, 4), gn=nn.GroupNorm(4, 4))
direct("native_group_norm", aten.native_group_norm.default, [N(4, 8, 6), N(8), N(8)],
       x0, x1, x2, 4, 8, 6, 4, 1e-5, meshes=WITH_4)
cap("instance_norm", lambda m, x, y: (m.inn(x), F.instance_norm(y)), N(2, 4, 3, 4), N(4, 4, 6),
    inn=nn.InstanceNorm2d(4, affine=True), meshes=WITH_4)
cap("instance_norm_stats", lambda m, x: m.inn(x), N(2, 4, 6),
    inn=nn.InstanceNorm1d(4, track_running_stats=True))
cap("softmax", lambda m, x: (x.softmax(-1), x.log_softmax(1)), N(2, 4, 6))
direct("_softmax", aten._softmax.default, [N(2, 4, 6)], x0, 1, False)
direct("_log_softmax", aten._log_softmax.default, [N(2, 4, 6)], x0, -1, False)

# ---------------------------------------------------------------- views
cap("view", lambda m, x: x.view(4, 2, 6), N(2, 4, 6), meshes=WITH_4)
cap("reshape_merge", lambda m, x: x.reshape(8, 6), N(2, 4, 6))
cap("flatten", lambda m, x: x.flatten(1), N(2, 4, 6))
cap("transpose", lambda m, x: x.transpose(0, 2), N(2, 4, 6))
cap("t", lambda m, x: x.t(), N(4, 6))
# 0-d and 1-d tensors (issue 64, cause 4: transpose of a 0-d tensor raised IndexError
# while planning)
cap("transpose_0d", lambda m, x: (x.transpose(0, -1), x.t()), N())
cap("transpose_1d", lambda m, x: (x.transpose(0, -1), x.t()), N(4))
cap("permute", lambda m, x: x.permute(2, 0, 1), N(2, 4, 6))
cap("flip", lambda m, x: (x.flip(1), x.flip([0, -1])), N(2, 4, 6))
cap("roll", lambda m, x: (x.roll(1, 1), x.roll((1, -2), (0, 2)), x.roll(3)), N(2, 4, 6))
cap("unsqueeze", lambda m, x: x.unsqueeze(1), N(4, 6))
cap("squeeze_dim", lambda m, x: (x.squeeze(1), x.squeeze(0)), N(2, 1, 6))
cap("squeeze_all", lambda m, x: x.squeeze(), N(2, 1, 4))
direct("squeeze_dims", aten.squeeze.dims, [N(2, 1, 4, 1)], x0, [0, 1, 3])
cap("expand", lambda m, x: x.unsqueeze(0).expand(2, 4, 6), N(4, 6))
direct("expand_as", aten.expand_as.default, [N(4, 1, 6), N(2, 4, 4, 6)], x0, x1, meshes=WITH_4)
cap("expand_bcast", lambda m, x: x.expand(4, 4, 6), N(4, 1, 6))
cap("split", lambda m, x: (x.split(2, 1), x.split([1, 3], 1)), N(2, 4, 6))
cap("chunk", lambda m, x: x.chunk(3, -1), N(2, 4, 6))
direct("chunk_direct", aten.chunk.default, [N(2, 4, 6)], x0, 2, 1)
direct("split_direct", aten.split.Tensor, [N(2, 4, 6)], x0, 2, 2)
cap("unbind", lambda m, x: x.unbind(1), N(2, 4, 6))
cap("slice", lambda m, x: (x[:, 1:3], x[:, :, 0:6], x[..., ::2]), N(2, 4, 6))
cap("select", lambda m, x: (x[:, 1], x[1]), N(2, 4, 6))
cap("cat", lambda m, x, y: torch.cat([x, y], 1), N(2, 4, 6), N(2, 2, 6))
# an empty input of full rank must shard like the others (it was left whole: the local
# cat failed on its size); a 1-D empty one is skipped by cat
cap("cat_empty", lambda m, x, y, z: (torch.cat([x, y]), torch.cat([z, y])), N(0, 4), N(4, 4),
    N(0))
cap("stack", lambda m, x, y: (torch.stack([x, y]), torch.stack([x, y], 2)), N(2, 4), N(2, 4))
cap("view_as", lambda m, x, y: (x.view_as(y), x.reshape_as(y)), N(4, 6), N(2, 12))
direct("view_as_direct", aten.view_as.default, [N(4, 6), N(2, 12)], x0, x1)
direct("reshape_as_direct", aten.reshape_as.default, [N(4, 6), N(2, 2, 6)], x0, x1)
direct("_unsafe_view", aten._unsafe_view.default, [N(4, 6)], x0, [2, 2, 6])
direct("reshape_direct", aten.reshape.default, [N(4, 6)], x0, [24])

cap("pad", lambda m, x: (F.pad(x, (1, 2)), F.pad(x, (1, 1, 0, 2), value=0.5)), N(2, 4, 6))
direct("pad_reflect", aten.pad.default, [N(2, 4, 6)], x0, [1, 1], "reflect")
direct("constant_pad_nd", aten.constant_pad_nd.default, [N(2, 4, 6)], x0, [1, 1, 2, 0], 0.5)
# factories: no tensor input, replicated (and no warning)
for _op, _args, _kw in [(aten.arange.default, (8,), {}), (aten.arange.start, (2, 10), {}),
                        (aten.arange.start_step, (0, 8, 2), {"dtype": F64}),
                        (aten.full.default, ([4, 6], 2.0), {}), (aten.zeros.default, ([4, 6],), {}),
                        (aten.ones.default, ([4, 6],), {}), (aten.scalar_tensor.default, (3.0,), {}),
                        (aten.linspace.default, (0.0, 1.0, 8), {})]:
    direct(str(_op), _op, [], *_args, **_kw)
direct("empty", aten.empty.memory_format, [], [4, 6], shape_only=True)
direct("new_zeros", aten.new_zeros.default, [N(4, 6)], x0, [3, 5])
direct("new_ones", aten.new_ones.default, [N(4, 6)], x0, [3, 5])
direct("new_full", aten.new_full.default, [N(4, 6)], x0, [3, 5], 2.0)
direct("new_empty", aten.new_empty.default, [N(4, 6)], x0, [3, 5], shape_only=True)


def _placeholders(g: fx.Graph, xs: list[torch.Tensor]) -> list[fx.Node]:
    """One placeholder per example tensor, carrying it as ``meta["val"]``."""
    phs = []
    for i, x in enumerate(xs):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = x
        phs.append(p)
    return phs
