"""Enumerate every node's candidate strategies (the search space) and apply pins.

Placeholders and parameters may take any non-Partial placement the mesh divides;
inputs arrive whole on every rank and are sliced locally (free), and parameters are
sharded once at start-up.  ``getitem`` of a tuple takes its producer's strategy.
"""

from __future__ import annotations

import fnmatch
import itertools
import operator
from collections.abc import Mapping

from torch import fx
from torch.distributed.tensor import Shard
from torch.fx.node import map_aggregate

from autopar.capture.grad_regions import KEEP_REPLICATED
from autopar.capture.ir import info, tensor_inputs
from autopar.errors import PlanError
from autopar.plans.placement import Placements, R, fmt_placements, parse_placements, valid_for_shape
from autopar.sharding.rules import OpStrategy, RuleCtx, op_strategies

Pins = Mapping[str, "Placements | str"]


def tensor_placements(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[Placements]:
    """All non-Partial placement tuples that divide ``shape`` evenly."""
    per_axis = [R] + [Shard(d) for d in range(len(shape))]
    return [ps for ps in itertools.product(per_axis, repeat=len(mesh_shape))
            if valid_for_shape(ps, shape, mesh_shape)]


def input_index(gm: fx.GraphModule) -> dict[str, int]:
    """Placeholder name -> position among the model's inputs."""
    return {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}


def _hashable(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    hash(v)  # TypeError for an argument the signature cannot hold
    return v


def signature(node: fx.Node) -> tuple | None:
    """What an op's strategies depend on, as a hashable key (``None``: not keyable).

    Rules read the op (target), its arguments and the shapes and dtypes of the node and
    its tensor inputs, nothing else (no producers, no users, no names).  Tensor inputs are
    keyed by their position in ``tensor_inputs`` so that which arguments are the same
    node is part of the key (``sdpa(x, x, x)`` is not ``sdpa(q, k, v)``); any other node
    argument by its name, which keeps it apart from every other node's.  The 32 layers of
    a Llama then share one key per op of a layer: enumerate once, not 32 times."""
    pos = {x: i for i, x in enumerate(tensor_inputs(node))}

    def enc(a: object) -> object:
        if isinstance(a, fx.Node):
            if a in pos:
                return ("input", pos[a], info(a).outputs)
            return ("node", a.name)
        return a

    try:
        return (node.target, _hashable(map_aggregate(node.args, enc)),
                _hashable(map_aggregate(dict(node.kwargs), enc)),
                info(node).outputs, info(node).tuple_output)
    except TypeError:
        return None


def enumerate_strategies(gm: fx.GraphModule, mesh_shape: tuple[int, ...]) -> dict[fx.Node, list[OpStrategy]]:
    """Candidate strategies of every tensor-producing node (in graph order); nodes with
    one :func:`signature` share one enumeration (each gets its own list)."""
    ctx = RuleCtx(tuple(mesh_shape))
    out: dict[fx.Node, list[OpStrategy]] = {}
    seen: dict[tuple, list[OpStrategy]] = {}
    for node in gm.graph.nodes:
        ni = info(node)
        if node.op in ("placeholder", "get_attr"):
            if not ni.outputs:
                continue
            if node.op == "get_attr" and ni.param is None:
                out[node] = [OpStrategy((), ((R,) * len(mesh_shape),))]  # buffers, constants
            else:
                out[node] = [OpStrategy((), (p,)) for p in tensor_placements(ni.out.shape, mesh_shape)]
        elif node.op == "call_function":
            if node.target is operator.getitem:
                src = node.args[0]
                if src in out and info(src).tuple_output:
                    idx = node.args[1]
                    out[node] = [OpStrategy((), (s.outputs[idx],)) for s in out[src]]
                continue
            if ni.outputs:
                key = signature(node)
                if key is None:
                    out[node] = op_strategies(node, ctx)
                else:
                    if key not in seen:
                        seen[key] = op_strategies(node, ctx)
                    out[node] = list(seen[key])
                if node.meta.get(KEEP_REPLICATED):
                    out[node] = out[node][:1]  # the registry lists all-replicate first
    return out


def _pin_key_matches(key: str, node: fx.Node, aliases: Mapping[str, list[str]],
                     inputs: Mapping[str, int]) -> bool:
    if any(c in key for c in "*?["):
        # glob patterns match parameters only ("*": every parameter)
        names = [node.target, *aliases.get(node.target, ())] if node.op == "get_attr" else []
        return info(node).param is not None and any(fnmatch.fnmatchcase(n, key) for n in names)
    if node.op == "get_attr":
        return key == node.target or key in aliases.get(node.target, ())
    if node.op == "placeholder":
        return key in (f"input:{inputs[node.name]}", node.name)
    return key == node.name


def apply_pins(strategies: dict[fx.Node, list[OpStrategy]], pins: Pins, mesh_shape: tuple[int, ...],
               aliases: Mapping[str, list[str]], gm: fx.GraphModule) -> None:
    """Keep only the strategies whose output placement equals each pin.

    A pin names a parameter (original or graph name), ``input:i`` or a node name, or
    is a glob pattern over parameter names (``"*.fc1.weight"``, ``"*"``), and gives one
    placement per mesh axis (``(Shard(0), Replicate())`` or ``"S(0)R"``).  An exact
    name wins over a pattern that also matches it.
    """
    inputs = input_index(gm)
    # patterns first, so exact names applied afterwards override them
    ordered = sorted(pins.items(), key=lambda kv: not any(c in kv[0] for c in "*?["))
    pinned_exact: set[fx.Node] = set()
    full: dict[fx.Node, list[OpStrategy]] = {}
    for key, value in ordered:
        want = parse_placements(value) if isinstance(value, str) else tuple(value)
        if len(want) != len(mesh_shape):
            raise PlanError(f"pin {key!r}: {len(want)} placements for a {len(mesh_shape)}-axis mesh")
        is_glob = any(c in key for c in "*?[")
        hits = [n for n in strategies if _pin_key_matches(key, n, aliases, inputs)]
        if not hits:
            raise PlanError(f"pin {key!r} names no parameter, input or node of the model")
        for n in hits:
            if is_glob and n in pinned_exact:
                continue
            if not is_glob:
                pinned_exact.add(n)
            pool = full[n] if n in full else strategies[n]
            kept = [s for s in pool if s.outputs[0] == want]
            if not kept:
                options = sorted({fmt_placements(s.outputs[0]) for s in strategies[n]})
                raise PlanError(
                    f"pin {key!r} = {fmt_placements(want)} is not possible for {n.name} "
                    f"(shape {info(n).outputs[0].shape} on mesh {tuple(mesh_shape)}); "
                    f"possible: {', '.join(options)}"
                )
            full.setdefault(n, strategies[n])
            strategies[n] = kept
