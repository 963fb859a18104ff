"""Attention masks that are only causal become ``is_causal=True``; masks that block
nothing are dropped.

Hugging Face models build their attention mask inside ``forward``.  The plain model, run
eagerly, sees that the mask is causal and nothing more, and calls SDPA with
``is_causal=True`` and no mask.  Under ``torch.export`` that check is skipped, so the
captured graph builds a ``batch x 1 x seq x seq`` boolean mask from ``arange``,
``index`` and ``cumsum`` ops and hands it to SDPA.  A tensor mask rules out the fused
flash kernel on a GPU: at 4 x 32 heads x 2048 x 64 (bf16, one H200) SDPA's forward and
backward took 0.83 ms a layer with ``is_causal=True`` and 1.96 ms with the mask
(``benchmarks/gpu_step.py --unfolded`` compares whole steps).

A mask computed from no input, parameter or buffer (only from shapes and constants) is
the same on every call, so it is evaluated once here.  When it equals the causal mask,
``tril(ones(q_len, kv_len))`` as SDPA's ``is_causal`` means it (or its additive form:
0 where allowed, ``-inf`` or the dtype's lowest where not, which softmax turns into the
same zeros), SDPA gets ``is_causal=True`` and no mask, and the mask's ops are dropped.
A mask that blocks nothing (ViT's, built the same way) is dropped alike.
Anything else stays as it was: a padding mask from the user's ``attention_mask``, packed
sequences from ``position_ids``, a sliding window narrower than the sequence.

In a graph with a symbolic batch (:mod:`autopar.capture.batch`) the batch size is a
shape read from an input; the mask is evaluated at two batch sizes there, since the
graph is later copied at every micro-batch size.  A mask too large to evaluate cheaply
(more than :data:`MAX_ELEMENTS` elements, as a global batch of many ranks makes it) is
evaluated at batches of 2 and 3 instead (the capture's batch size read as those), and
must come out causal at both; one too large even so is left as it is, and the log says
so.
"""

from __future__ import annotations

import enum

import torch
from torch import fx

from autopar.capture.ir import arg
from autopar.log import log

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MASK_ARG = 3  # SDPA's positional index of attn_mask
AFTER_QKV = ("attn_mask", "dropout_p", "is_causal")  # SDPA's positional ones, in order
#: the most mask elements evaluated at capture (2**27 booleans: 128 MiB, a few tenths
#: of a second on one core); a larger mask is evaluated at batches of 2 and 3
MAX_ELEMENTS = 2 ** 27


class Form(enum.Enum):
    """What a mask computed at capture stands for."""

    CAUSAL = "causal"  # SDPA's is_causal=True
    NONE = "none"  # blocks nothing: no mask
    TENSOR = "tensor"  # anything else, or not known: kept as it is


def _is_shape_read(n: fx.Node) -> bool:
    """``sym_size`` of a graph input: a shape, not the input's values."""
    return (n.op == "call_function" and n.target is aten.sym_size.int
            and n.args[0].op == "placeholder")


def constant_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, or ``None`` when it reads
    any input, parameter or buffer value, or draws random numbers."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_shape_read(n):
            continue
        if n.op != "call_function":
            return None
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _hinted(v: object) -> int | None:
    """An int, or a symbolic int's example value (``None`` without one)."""
    if isinstance(v, int):
        return v
    hint = getattr(getattr(v, "node", None), "hint", None)
    return None if hint is None else int(hint)


def _shape_value(n: fx.Node, extra: int) -> int | None:
    val = n.meta.get("val")
    if isinstance(val, int):
        return val
    hint = _hinted(val)
    return None if hint is None else hint + extra


def evaluate_constant(nodes: list[fx.Node], extra: int = 0,
              batch: tuple[int | None, int] | None = None) -> torch.Tensor | None:
    """The last of ``nodes`` computed on the CPU; symbolic shapes at their example value
    plus ``extra``.  ``batch=(b, k)`` computes it at batch ``k`` instead: symbolic shapes
    are ``k``, and so is every integer argument equal to ``b``, the batch a fixed-size
    graph was captured at.  ``None`` when a shape has no example value or a step fails."""
    env: dict[fx.Node, object] = {}

    def load(a: object) -> object:
        return env[a] if isinstance(a, fx.Node) else a

    def literal(a: object) -> object:
        return batch[1] if type(a) is int and a == batch[0] else a

    for n in nodes:
        if _is_shape_read(n):
            symbolic = not isinstance(n.meta.get("val"), int)
            v = batch[1] if batch is not None and symbolic else _shape_value(n, extra)
            if v is None:
                return None
            env[n] = v
            continue
        args, kwargs = n.args, n.kwargs
        if batch is not None and batch[0] is not None:
            args, kwargs = fx.node.map_aggregate(args, literal), fx.node.map_aggregate(kwargs, literal)
        args = fx.node.map_aggregate(args, load)
        kwargs = dict(fx.node.map_aggregate(kwargs, load))
        if "device" in kwargs:  # a model captured on the meta device: the values here
            kwargs["device"] = torch.device("cpu")
        try:
            env[n] = n.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - anything it cannot compute is left alone
            return None
    out = env[nodes[-1]]
    return out if isinstance(out, torch.Tensor) else None


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """Where ``mask`` lets a query attend a key (``None``: not a mask form SDPA's kernels
    can stand in for).  Additive: 0 is allowed, ``-inf`` or the dtype's lowest value is
    blocked (softmax gives both exact zeros); any other value is a bias, not a mask."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    blocked = mask <= torch.finfo(mask.dtype).min
    if not bool((mask.masked_fill(blocked, 0) == 0).all()):
        return None
    return ~blocked


def _form(mask: torch.Tensor, q_len: int, kv_len: int) -> Form:
    """What ``mask`` (broadcast to ``... x q_len x kv_len``) stands for."""
    allowed = _allowed(mask)
    if allowed is None or mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return Form.TENSOR
    if bool(allowed.all()):
        return Form.NONE
    if bool((allowed == torch.ones(q_len, kv_len, dtype=torch.bool).tril()).all()):
        return Form.CAUSAL
    return Form.TENSOR


def _symbolic(nodes: list[fx.Node]) -> bool:
    return any(_is_shape_read(n) and not isinstance(n.meta.get("val"), int) for n in nodes)


def _mask_form(mask: fx.Node, q_len: int, kv_len: int) -> Form:
    nodes = constant_ancestors(mask)
    if nodes is None:
        return Form.TENSOR
    val = mask.meta.get("val")
    numel = _hinted(val.numel()) if isinstance(val, torch.Tensor) else None
    rows = _hinted(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 4 else None
    symbolic = _symbolic(nodes)
    if numel is not None and numel <= MAX_ELEMENTS:
        # a symbolic batch: the graph is later copied at other sizes, so check two of them
        trials = [{"extra": e} for e in ((0, 1) if symbolic else (0,))]
    elif numel is not None and rows is not None and rows > 3 and numel // rows * 3 <= MAX_ELEMENTS:
        # a large batch (the global batch of many data-parallel ranks): the mask at
        # batches of 2 and 3, its batch rows being what depends on the batch
        trials = [{"batch": (None if symbolic else rows, k)} for k in (2, 3)]
    else:
        log.info("attention mask %s (%s elements) kept as a tensor: too large to check at "
                 "capture; SDPA cannot use a fused kernel on it", mask.name, numel)
        return Form.TENSOR
    forms = set()
    for trial in trials:
        value = evaluate_constant(nodes, **trial)
        k = trial.get("batch", (None, None))[1]
        if value is None or (k is not None and (value.dim() != 4 or value.shape[0] != k)):
            return Form.TENSOR  # the batch did not shrink where expected: do not guess
        forms.add(_form(value, q_len, kv_len))
    return forms.pop() if len(forms) == 1 else Form.TENSOR


def _shape(node: object) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def fold_causal_masks(gm: fx.GraphModule) -> int:
    """Give every SDPA whose mask is exactly causal ``is_causal=True`` and no mask, drop
    a mask that blocks nothing, and drop the ops that built them (in place; the caller recompiles).  Returns how many
    attention calls changed."""
    g = gm.graph
    verdict: dict[fx.Node, Form] = {}  # one mask node is shared by every layer
    changed = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not SDPA:
            continue
        mask = arg(n, MASK_ARG, "attn_mask")
        q, k = _shape(n.args[0]), _shape(n.args[1])
        causal = bool(arg(n, MASK_ARG + 2, "is_causal", False))
        if not isinstance(mask, fx.Node) or causal or q is None or k is None:
            continue
        if not all(isinstance(d, int) for d in (q[-2], k[-2])):
            continue
        if mask not in verdict:
            verdict[mask] = _mask_form(mask, q[-2], k[-2])
        if verdict[mask] is Form.TENSOR:
            continue
        # the arguments after q, k, v as keywords, less the mask
        kwargs = {**dict(zip(AFTER_QKV, n.args[MASK_ARG:])), **n.kwargs}
        kwargs.pop("attn_mask", None)
        if verdict[mask] is Form.CAUSAL:
            kwargs["is_causal"] = True
        n.args, n.kwargs = tuple(n.args[:MASK_ARG]), kwargs
        changed += 1
    if changed:
        # the mask's ops now have no users; nothing else in a captured graph is dead
        # code that matters, and the op is pure, so eliminate them
        drop_unused(g, [m for m, form in verdict.items() if form is not Form.TENSOR])
    return changed


def drop_unused(g: fx.Graph, roots: list[fx.Node]) -> None:
    """Erase ``roots`` and, transitively, the inputs they leave without users."""
    stack = list(roots)
    erased: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        g.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


__all__ = ["MAX_ELEMENTS", "Form", "constant_ancestors", "drop_unused", "evaluate_constant",
           "fold_causal_masks"]
