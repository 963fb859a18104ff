"""Group graph nodes into *layers*: the units of pipeline stages, recomputation and
repeated-layer clustering.

A layer is the subgraph of one entry of an ``nn.ModuleList``/``nn.Sequential`` child
(``blocks.3``, ``transformer.h.7``), read from the ``nn_module_stack`` that
``torch.export`` records on every node.  Nodes before the first such entry form the
``"pre"`` layer (embeddings), nodes after the last one the ``"post"`` layer (final norm,
head, loss).  A parameter (``get_attr``) belongs to the layer of its first user.

Example (examples/gpt.py, 2 blocks): ``["pre", "blocks.0", "blocks.1", "post"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

PRE = "pre"
POST = "post"


@dataclass
class Layer:
    """One layer: its key, position and nodes (graph order)."""

    key: str
    index: int
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def repeated(self) -> bool:
        """True for ModuleList entries (not the pre/post groups)."""
        return self.key not in (PRE, POST)


def _indexed_prefix(path: str) -> str | None:
    """The module path up to and including its first integer component
    (``"blocks.3.attn.q_proj"`` -> ``"blocks.3"``), or None."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _module_key(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ in stack.values():
        key = _indexed_prefix(path)
        if key is not None:
            return key
    return None


def layer_keys(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Layer key of every node (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    keys: dict[fx.Node, str] = {}
    last_indexed = max((i for i, n in enumerate(nodes) if _module_key(n) is not None), default=-1)
    current = PRE
    for i, n in enumerate(nodes):
        if n.op in ("get_attr", "placeholder", "output"):
            continue
        k = _module_key(n)
        if k is not None:
            current = k
        elif i > last_indexed:
            current = POST
        keys[n] = current
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "get_attr":
            users = [u for u in n.users if u in keys]
            keys[n] = keys[min(users, key=pos.__getitem__)] if users else PRE
        elif n.op == "placeholder":
            keys[n] = PRE
        elif n.op == "output":
            keys[n] = POST
    return keys


def layers(gm: fx.GraphModule) -> list[Layer]:
    """Layers in graph order; every node belongs to exactly one."""
    keys = layer_keys(gm)
    # order layers by their first computing node: get_attr nodes sit at the top
    order: list[str] = [PRE]
    for n in gm.graph.nodes:
        if n.op not in ("get_attr", "placeholder") and keys[n] not in order:
            order.append(keys[n])
    for k in keys.values():
        if k not in order:
            order.append(k)
    out = {k: Layer(k, i) for i, k in enumerate(order)}
    for n in gm.graph.nodes:
        out[keys[n]].nodes.append(n)
    result = [lay for lay in out.values() if lay.nodes]
    for i, lay in enumerate(result):
        lay.index = i
    return result


__all__ = ["Layer", "POST", "PRE", "layer_keys", "layers"]
