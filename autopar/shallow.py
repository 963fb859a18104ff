"""A shallow copy of a model whose repeated layers are identical: the joint search's
estimates for candidates it would otherwise capture at full depth.

The joint search captures the model at every micro-batch size it tries.  That is one
``torch.export`` each: 15 s for an 80-layer Llama-3 70B on this 2-core machine, and
62 of the 97 s a 1,024-device plan took.  When the plain candidate's per-layer numbers
show every repeated layer alike (:func:`homogeneous`), a copy of the model with its
layer list cut to two layers (:func:`shallow_copy`) stands in for the others.  It is
captured in a fraction of the time and its layer statistics are extrapolated to full
depth (:func:`deepen`).  Those candidates are estimates, used to choose.
The one chosen is captured at full depth and planned exactly before it can win
(:mod:`autopar.joint`).

The copy shares every parameter and buffer with the model and changes nothing in it:
only the modules on the path to the layer list are copied, with their child dicts.
"""

from __future__ import annotations

import copy
import dataclasses
import re

from torch import nn

from autopar.solve.layer_stats import LayerStat

KEEP = 2
"""Layers the shallow copy keeps: two, so its graph has a repeated layer after the first
(the repeated-layer solver needs two; the second one's numbers are extrapolated)."""


def _same(a: LayerStat, b: LayerStat) -> bool:
    """Equal per-layer numbers (parameter names and the layer key aside)."""
    strip = [dataclasses.replace(p, name="") for p in a.params], \
        [dataclasses.replace(p, name="") for p in b.params]
    return (a.seconds, a.forward, a.compute, a.activations, a.out_bytes, a.buffers) == \
        (b.seconds, b.forward, b.compute, b.activations, b.out_bytes, b.buffers) and \
        strip[0] == strip[1]


def homogeneous(stats: list[LayerStat]) -> tuple[str, int] | None:
    """(``path``, count) when the layers other than ``pre`` and ``post`` are
    ``<path>.0`` .. ``<path>.<count-1>`` and every one after the first has identical
    numbers, else ``None``.  The first may differ: it pays for its input's
    redistribution from ``pre`` (Llama's layer 0: 12.4 against 11.1 ms).  A shallow
    copy's first and second layers then give every layer's numbers exactly
    (:func:`deepen`)."""
    body = [st for st in stats if st.key not in ("pre", "post")]
    if len(body) <= KEEP:
        return None
    m = re.fullmatch(r"(.+)\.(\d+)", body[0].key)
    if m is None:
        return None
    path = m.group(1)
    if [st.key for st in body] != [f"{path}.{i}" for i in range(len(body))]:
        return None
    return (path, len(body)) if all(_same(body[1], st) for st in body[2:]) else None


def deepen(stats: list[LayerStat], path: str, depth: int) -> list[LayerStat]:
    """A shallow copy's statistics at full depth: ``pre``, its first layer, ``depth - 1``
    copies of its last layer (keys ``<path>.1`` ..), ``post``."""
    body = [st for st in stats if st.key not in ("pre", "post")]
    copies = [dataclasses.replace(body[-1], key=f"{path}.{i}") for i in range(1, depth)]
    return ([st for st in stats if st.key == "pre"] + body[:1] + copies
            + [st for st in stats if st.key == "post"])


def shallow_copy(model: nn.Module, path: str, keep: int = KEEP) -> nn.Module | None:
    """``model`` with the ``nn.ModuleList`` at ``path`` cut to its first ``keep`` layers,
    sharing everything else; ``None`` when ``path`` names no such list."""
    names = path.split(".")
    chain = [model]
    for name in names:
        child = chain[-1]._modules.get(name)
        if child is None:
            return None
        chain.append(child)
    layers = chain[-1]
    if not isinstance(layers, nn.ModuleList) or len(layers) <= keep:
        return None
    copies = []
    for m in chain[:-1]:
        c = copy.copy(m)
        c._modules = dict(m._modules)  # copy.copy shares the dict: the model would change
        copies.append(c)
    for i in range(len(copies) - 1):  # each copy holds the next one, not the original
        copies[i]._modules[names[i]] = copies[i + 1]
    copies[-1]._modules[names[-1]] = nn.ModuleList(list(layers)[:keep])
    return copies[0]


__all__ = ["KEEP", "deepen", "homogeneous", "shallow_copy"]
