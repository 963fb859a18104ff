"""Train/eval mode of generated graphs.

torch.export records the module's mode as an argument of the ops that depend on it
(``aten.dropout.default(x, p, train)``, ``aten.batch_norm.default(..., training, ...)``),
so switching modes is setting that argument; no re-capture, no re-plan.  Ops that the
localize pass substitutes (e.g. autopar's sharded dropout) declare the index of their
mode argument in ``_autopar_train_arg``.

Before: graphs captured in training mode (or a previous ``set_train_mode``).
After: the same graphs with every mode argument set to ``mode``, recompiled.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

aten = torch.ops.aten

# op -> index of its "training" positional argument
TRAIN_ARG = {
    aten.dropout.default: 2,
    aten.feature_dropout.default: 2,
    aten.alpha_dropout.default: 2,
    aten.feature_alpha_dropout.default: 2,
    aten.batch_norm.default: 5,
    aten.instance_norm.default: 5,
}


# norms whose argument 3 is the running mean: without running statistics nn's modules
# normalise by the batch's in eval too (they pass ``training=True`` in both modes), and
# aten refuses eval mode without them
_RUNNING_STATS_AT_3 = {aten.batch_norm.default, aten.instance_norm.default}


def _train_arg(target) -> int | None:
    if target in TRAIN_ARG:
        return TRAIN_ARG[target]
    return getattr(target, "_autopar_train_arg", None)


def _mode_free(n: fx.Node) -> bool:
    """A norm without running statistics: its mode argument stays as captured."""
    stats_at_3 = n.target in _RUNNING_STATS_AT_3 or getattr(n.target, "_autopar_stats_arg", None) == 3
    return stats_at_3 and len(n.args) > 3 and n.args[3] is None


def set_train_mode(graphs: Iterable[fx.GraphModule], mode: bool) -> None:
    """Set the mode argument of every mode-dependent op in ``graphs`` (see module docstring)."""
    for gm in graphs:
        changed = False
        for n in gm.graph.nodes:
            i = _train_arg(n.target) if n.op == "call_function" else None
            if i is None or len(n.args) <= i or n.args[i] == mode or _mode_free(n):
                continue
            args = list(n.args)
            args[i] = bool(mode)
            n.args = tuple(args)
            changed = True
        if changed:
            gm.recompile()


__all__ = ["TRAIN_ARG", "set_train_mode"]
