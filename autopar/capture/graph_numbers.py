"""A graph's ops and wiring apart from its numbers, and its numbers: what two captures
or lowerings of one model at different shapes share, and where they differ
(:mod:`autopar.module.shape_template`, :mod:`autopar.capture.any_shape`), and a symbolic
graph's values given numbers (:mod:`autopar.capture.batch`, :mod:`autopar.capture.any_shape`)."""

from __future__ import annotations

import sympy
import torch
from torch import fx

SYMBOLIC = (torch.SymInt, torch.SymBool, torch.SymFloat)
"""A symbolic export's values that stand for numbers."""

NUMBER = (int, float)
"""What counts as a number in an op's arguments (``bool`` is excluded where read)."""


def _walk(a: object, out: list) -> None:
    """The numbers in ``a`` (an argument: nested tuples, lists and dicts), in order."""
    if isinstance(a, bool) or a is None:
        return
    if isinstance(a, NUMBER):
        out.append(a)
    elif isinstance(a, (tuple, list)):
        for x in a:
            _walk(x, out)
    elif isinstance(a, dict):
        for x in a.values():
            _walk(x, out)


def _skeleton(a: object) -> object:
    """``a`` with its numbers replaced by their type: what graphs of one family share."""
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, NUMBER):
        return type(a).__name__
    if isinstance(a, fx.Node):
        return "node"
    if isinstance(a, (tuple, list)):
        return tuple(_skeleton(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _skeleton(v)) for k, v in a.items())
    return repr(a)


def signature(gm: fx.GraphModule) -> tuple:
    """The graph's ops, their inputs (by position) and the shape of their arguments:
    equal for two lowerings of a plan at different shapes."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    sig = []
    for n in gm.graph.nodes:
        ins = tuple(index[u] for u in n.all_input_nodes)
        target = n.target if n.op != "call_function" else getattr(n.target, "__qualname__", str(n.target))
        sig.append((n.op, str(target), ins, _skeleton(n.args), _skeleton(n.kwargs)))
    return tuple(sig)


def numbers(gm: fx.GraphModule) -> list:
    """Every number the graph's ops take, in graph order."""
    out: list = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            _walk(n.args, out)
            _walk(n.kwargs, out)
    return out



def value_at(val: object, env: dict[sympy.Symbol, int]) -> object:
    """The value of a symbolic int/bool/float with its symbols at ``env``'s numbers
    (ValueError when it depends on another symbol)."""
    expr = sympy.sympify(val.node.expr).xreplace({s: sympy.Integer(k) for s, k in env.items()})  # type: ignore[union-attr]
    if expr.free_symbols:
        raise ValueError(f"{expr} depends on more than {sorted(map(str, env))}")
    if isinstance(val, torch.SymBool):
        return bool(expr)
    return int(expr) if isinstance(val, torch.SymInt) else float(expr)


def inline(node: fx.Node, value: object) -> None:
    """Replace every use of ``node`` by the constant ``value`` and remove it."""
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = fx.map_arg(user.kwargs, lambda a: value if a is node else a)
    node.graph.erase_node(node)


__all__ = ["NUMBER", "SYMBOLIC", "inline", "numbers", "signature", "value_at"]
