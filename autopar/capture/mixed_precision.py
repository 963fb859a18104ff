"""Mixed precision as explicit casts in the captured graph (``precision="bf16-mixed"``
or ``"fp16-mixed"``: the same policy with float16 as the low dtype).

``torch.export`` ignores an enclosing ``torch.autocast``: the captured graph runs in the
model's own dtype. This pass writes autocast's policy into the graph instead, as
``aten._to_copy`` casts, so that

- the plan prices what runs: every activation, message and saved tensor carries its real
  dtype (``meta["val"]`` is re-propagated), matmuls are priced at the low-precision peak;
- the runtime needs no autocast: the generated code casts (``print(pmodel.code)`` shows
  it), identically on CPU and GPU, and autograd turns each cast's gradient back into the
  parameter's dtype;
- parameters, their gradients and the optimizer state stay in the model's dtype (fp32
  master weights, as with ``torch.autocast`` and FSDP2's ``MixedPrecisionPolicy``).

The policy is CUDA autocast's (the clusters autopar plans for), reduced to the aten ops
a training graph holds:

- :data:`LOW_PRECISION` ops (matmuls, convolutions, attention) get every floating input
  cast to the low dtype, so they compute and return it;
- :data:`FULL_PRECISION` ops (norms, softmax, losses, exp/log/pow and reductions whose
  precision matters) get low-precision inputs cast back to fp32;
- every other op runs in the dtype its inputs have (type promotion: ``bf16 + fp32`` is
  fp32, so a residual stream kept in fp32 stays fp32, as under autocast);
- the experts op ``autopar::moe_experts`` gets its expert weights cast (:data:`EXPERT_WEIGHTS`).

A source is cast once per target dtype and shared by its consumers (autocast casts an
activation per op; sharing computes and saves one copy instead of several).  Regions the
model itself runs under ``torch.autocast(enabled=False)`` or ``no_grad`` are captured as
higher-order-op subgraphs and are left as they are (Hugging Face's rotary tables stay fp32).

Before: ``linear(x_f32, w_f32, b_f32)``.
After: ``linear(_to_copy(x, bf16), _to_copy(w, bf16), _to_copy(b, bf16))`` returning bf16.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from autopar.plans.decisions import applies
from autopar.plans.kinds import Precision

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The aten overload packets among ``names`` that this torch has."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


LOW_PRECISION = _packets(
    "linear", "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "einsum", "mv", "addmv",
    "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
)
"""Ops that run in the low dtype (CUDA autocast's ``lower_precision_fp`` list)."""

FULL_PRECISION = _packets(
    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "rms_norm", "softmax", "_softmax", "log_softmax", "_log_softmax", "cross_entropy_loss",
    "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "binary_cross_entropy_with_logits", "kl_div", "exp", "expm1", "log",
    "log1p", "log2", "log10", "pow", "rsqrt", "reciprocal", "softplus", "logsumexp", "sum",
    "cumsum", "prod", "norm", "linalg_vector_norm", "cosine_similarity", "erfinv",
)
"""Ops that run in fp32 (CUDA autocast's ``fp32`` and ``fp32_set_opt_dtype`` lists)."""

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


EXPERT_WEIGHTS = (3, 4)
"""Arguments of ``autopar::moe_experts`` (gate_up, down: autopar/runtime/experts.py) cast
to the low dtype.  Its token rows and routing weights keep their dtypes: the kernel casts
each row at the matmul, and the product with the routing weights promotes back to
fp32, as transformers' experts loop computes under autocast."""


def _want(node: fx.Node, low: torch.dtype) -> torch.dtype | None:
    packet = getattr(node.target, "overloadpacket", None)
    if packet in LOW_PRECISION:
        return low
    if packet in FULL_PRECISION:
        return torch.float32
    return None


def _is_experts(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) == "autopar.moe_experts.default"


@applies("precision")
def apply_mixed_precision(gm: fx.GraphModule, precision: Precision | str,
                          low: torch.dtype | None = None, recompile: bool = True) -> int:
    """Insert the casts of ``precision`` into ``gm`` (see the module docstring) and
    re-propagate every node's ``meta["val"]``; returns how many casts were inserted.
    ``low``: the low dtype (default: the precision's, bf16 or fp16).
    ``recompile=False`` leaves regenerating ``gm``'s code to the caller."""
    precision = Precision.parse(precision)
    if precision is Precision.NATIVE:
        return 0
    low = low or precision.low
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    # in the capture's own fake mode, a node whose inputs kept their dtypes keeps its
    # ``meta["val"]`` as it is, without running it again (_CastingProp.run_node)
    mode = detect_fake_mode(vals)
    reuse = mode is not None
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        vals = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in vals]
    prop = _CastingProp(gm, mode, low, reuse)
    prop.propagate_dont_convert_inputs(*vals)
    if prop.casts:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return len(prop.casts)


def _dtypes(value: object) -> list:
    """The dtypes of the tensors in a node's value (a tensor or a pytree of them)."""
    return [getattr(x, "dtype", None) for x in pytree.tree_leaves(value)]


class _CastingProp(FakeTensorProp):
    """Fake-tensor propagation in graph order that casts a node's inputs just before the
    node runs, so every decision sees the dtypes the casts upstream produced."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, low: torch.dtype,
                 reuse: bool = False) -> None:
        super().__init__(gm, mode)
        self.low = low
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.reuse = reuse
        # nodes whose value's dtypes differ from the capture's: their users run again
        self.changed: set[fx.Node] = set()

    def run_node(self, n: fx.Node):
        """Cast ``n``'s floating inputs to the dtype its op runs in, then run it."""
        want = _want(n, self.low) if n.op == "call_function" else None
        if _is_experts(n):
            want = self.low
            sources = [a for i, a in enumerate(n.args) if i in EXPERT_WEIGHTS]
        else:
            sources = list(n.all_input_nodes)
        if want is not None:
            for src in sources:
                if not isinstance(src, fx.Node):
                    continue
                v = self.env.get(src)
                have = v.dtype if isinstance(v, torch.Tensor) else None
                if have is None or have == want or have not in _FLOATS:
                    continue
                if want is self.low and have != torch.float32:
                    continue  # fp64 stays fp64 (a deliberate choice of the model), as in autocast
                n.replace_input_with(src, self._cast(src, want, n))
        before = n.meta.get("val")
        if self.reuse and before is not None and n.op not in ("placeholder", "output") \
                and not any(u in self.changed for u in n.all_input_nodes):
            # same inputs as captured (same dtypes, same fake mode): same value.  Most of
            # a deep model's nodes; re-running them was ~1 s of an 8B Llama's capture
            return before
        out = super().run_node(n)
        if _dtypes(out) != _dtypes(before):
            self.changed.add(n)
        return out

    def _cast(self, src: fx.Node, want: torch.dtype, user: fx.Node) -> fx.Node:
        key = (src, want)
        if key not in self.casts:
            # placed right before its first user: a parameter's cast then sits in the
            # layer that uses it (get_attr nodes come first in an exported graph), which
            # keeps layers contiguous for the repeated-layer solver
            with self.module.graph.inserting_before(user):
                c = self.module.graph.call_function(aten._to_copy.default, (src,), {"dtype": want})
            c.meta.update({k: v for k, v in user.meta.items()
                           if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
            with self._mode:
                self.env[c] = self.env[src].to(want)
            c.meta["val"] = self.env[c]
            self.casts[key] = c
            self.changed.add(c)
        return self.casts[key]


__all__ = ["EXPERT_WEIGHTS", "FULL_PRECISION", "LOW_PRECISION", "apply_mixed_precision"]
