"""Retarget a captured graph to the device this rank computes on.

torch.export records the example inputs' device in factory and conversion calls
(``aten.arange(16, device=cpu)``, ``aten.to(x, dtype=..., device=cpu)``): a model
captured on the CPU (planning needs no GPU) would otherwise build its position ids and
masks on the CPU while its weights live on ``cuda:LOCAL_RANK``.

Before: graphs whose ``device`` keyword arguments name the capture device.
After: every ``device`` keyword argument (and positional ``torch.device``) names
``device``, and the graphs are recompiled.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx


def set_device(graphs: Iterable[fx.GraphModule], device: torch.device) -> int:
    """Point every device argument in ``graphs`` at ``device``; returns how many changed."""
    changed = 0
    for gm in graphs:
        touched = False
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            kw = n.kwargs.get("device")
            if isinstance(kw, torch.device) and kw != device:
                n.kwargs = {**n.kwargs, "device": device}
                touched = True
            if any(isinstance(a, torch.device) and a != device for a in n.args):
                n.args = tuple(device if isinstance(a, torch.device) else a for a in n.args)
                touched = True
        if touched:
            gm.recompile()
            changed += 1
    return changed


__all__ = ["set_device"]
