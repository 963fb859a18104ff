"""A shallow copy of a model whose repeated layers are identical: the joint search's
estimates for candidates it would otherwise capture at full depth.

The joint search captures the model at every micro-batch size it tries.  That is one
``torch.export`` each: 15 s for an 80-layer Llama-3 70B on this 2-core machine, and
62 of the 97 s a 1,024-device plan took.  When the plain candidate's per-layer numbers
show every repeated layer alike (:func:`homogeneous`), or a copy of the model whose
layer list is cut to four layers shows its middle two alike (:func:`steady`), that copy
(:func:`shallow_copy`) stands in for the model while the search compares candidates.  It is
captured in a fraction of the time and its layer statistics are extrapolated to full
depth (:func:`deepen`).  Those candidates are estimates, used to choose.
The one chosen is captured at full depth and planned exactly before it can win
(:mod:`autopar.search.joint`).

The copy shares every parameter and buffer with the model and changes nothing in it:
only the modules on the path to the layer list are copied, with their child dicts.
"""

from __future__ import annotations

import copy
import dataclasses
import re

from torch import nn

from autopar.errors import PlanError
from autopar.search.stages.layer_stats import LayerStat

KEEP = 4
"""Layers the shallow copy keeps: the first (it pays its input's redistribution), the
last (what leaves the stack may be counted with it) and two between, whose numbers must
agree (:func:`steady`) before they stand for every middle layer."""


def _same(a: LayerStat, b: LayerStat) -> bool:
    """Equal per-layer numbers (parameter names and the layer key aside)."""
    strip = [dataclasses.replace(p, name="") for p in a.params], \
        [dataclasses.replace(p, name="") for p in b.params]
    return (a.seconds, a.forward, a.compute, a.activations, a.largest, a.out_bytes, a.wire_bytes,
            a.buffers) == \
        (b.seconds, b.forward, b.compute, b.activations, b.largest, b.out_bytes, b.wire_bytes,
         b.buffers) and \
        strip[0] == strip[1]


def homogeneous(stats: list[LayerStat]) -> tuple[str, int] | None:
    """(``path``, count) when the layers other than ``pre`` and ``post`` are
    ``<path>.0`` .. ``<path>.<count-1>`` and every middle one has identical numbers,
    else ``None``.  The first may differ (it pays for its input's redistribution from
    ``pre``: Llama's layer 0, 12.4 against 11.1 ms) and so may the last (a residual add
    after it is counted with ``post`` or with it)."""
    body = [st for st in stats if st.key not in ("pre", "post")]
    if len(body) <= KEEP:
        return None
    m = re.fullmatch(r"(.+)\.(\d+)", body[0].key)
    if m is None:
        return None
    path = m.group(1)
    if [st.key for st in body] != [f"{path}.{i}" for i in range(len(body))]:
        return None
    return (path, len(body)) if all(_same(body[1], st) for st in body[2:-1]) else None


def steady(stats: list[LayerStat]) -> bool:
    """Whether a shallow copy's middle layers agree (they then stand for every middle
    layer of a stack of one kind)."""
    body = [st for st in stats if st.key not in ("pre", "post")]
    return len(body) >= KEEP and all(_same(body[1], st) for st in body[2:-1])


def repeated_list(model: nn.Module) -> tuple[str, int] | None:
    """(path, length) of the model's longest ``nn.ModuleList`` of one module class and
    more than :data:`KEEP` entries (a decoder's layers), or ``None``."""
    best: tuple[str, int] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > KEEP and len({type(c) for c in m}) == 1 \
                and (best is None or len(m) > best[1]):
            best = (name, len(m))
    return best


def deepen(stats: list[LayerStat], path: str, depth: int) -> list[LayerStat]:
    """A shallow copy's statistics at full depth: ``pre``, its first layer, ``depth - 2``
    copies of its second (keys ``<path>.1`` ..), its last layer, ``post``."""
    body = [st for st in stats if st.key not in ("pre", "post")]
    middle = [dataclasses.replace(body[1], key=f"{path}.{i}") for i in range(1, depth - 1)]
    last = dataclasses.replace(body[-1], key=f"{path}.{depth - 1}")
    return ([st for st in stats if st.key == "pre"] + body[:1] + middle + [last]
            + [st for st in stats if st.key == "post"])


def extrapolate_blocks(stats: list[LayerStat], blocks: int) -> list[LayerStat]:
    """``stats`` with its repeated blocks replaced by ``blocks`` copies of the last one
    (keys ``<prefix>.<i>``): identical blocks get identical intra-op plans, so a deep
    model's per-layer numbers follow from a shallow capture."""
    body = [st for st in stats if st.key not in ("pre", "post")]
    if not body:
        raise PlanError("blocks= needs a model with repeated blocks (an nn.ModuleList)")
    last = body[-1]
    prefix = last.key.rsplit(".", 1)[0]
    copies = [dataclasses.replace(last, key=f"{prefix}.{i}") for i in range(blocks)]
    return [st for st in stats if st.key == "pre"] + copies + [st for st in stats if st.key == "post"]


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


__all__ = ["KEEP", "deepen", "extrapolate_blocks", "homogeneous", "repeated_list", "shallow_copy",
           "steady"]
