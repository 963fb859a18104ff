"""The joint search's captures: the model at each micro-batch size, and the shallow copy
its estimates come from (:mod:`autopar.search.shallow`, :mod:`autopar.capture.batch`).

:class:`Captures` is held by :class:`autopar.search.joint.JointSearch` (and shared by the
searches of one model on several mesh shapes); it is given the model, the call, the
options and the search's timings, and keeps the captures.
"""

from __future__ import annotations

import re
import time

import torch
from torch import fx, nn

from autopar.capture.annotate import annotate
from autopar.capture.batch import AnyBatch, capture_any_batch
from autopar.capture.ir import info
from autopar.capture.trace import Captured, capture
from autopar.log import report
from autopar.plans.data import Request
from autopar.plans.decisions import PlanOptions
from autopar.plans.splits import batch_size, micro_inputs
from autopar.search.shallow import KEEP, homogeneous, repeated_list, shallow_copy
from autopar.search.stages.layer_stats import LayerStat


class Captures:
    """The captures of one joint search (see the module docstring): ``model`` called as
    ``call`` (positional inputs, keyword inputs) under ``opts``; capture and annotation
    seconds are added to ``timings``."""

    def __init__(self, model: nn.Module, call: tuple, opts: PlanOptions,
                 timings: dict[str, float]) -> None:
        self.model, self.call, self.opts, self.timings = model, call, opts, timings
        self.by_size: dict[tuple[int, bool], Captured] = {}
        """By (micro-batch size, from the shallow copy)."""
        self.shallow: tuple[nn.Module, int, str] | None = None
        """The model with its layer list cut to KEEP, the list's depth and path, while
        candidates are estimated from it."""
        self.exact = False
        """Never estimate again (the estimates proved wrong)."""
        self.generic: AnyBatch | bool | None = None
        """The shallow copy's (or ``blocks=`` model's) any-batch capture; False: none."""

    def share(self, other: Captures) -> None:
        """Use ``other``'s captures and shallow copy: the same model and call planned on
        another mesh (:mod:`autopar.search.mesh_shapes`) captures nothing twice."""
        self.by_size, self.generic, self.shallow = other.by_size, other.generic, other.shallow

    def first(self) -> Captured | None:
        """The first capture taken (any: what they share is the model's layers)."""
        return next(iter(self.by_size.values()), None)

    def at(self, micro: int, shallow: bool = False) -> Captured:
        """The model (``shallow``: its shallow copy) captured at the micro-batch size of
        ``micro`` micro-batches, annotated; captured once per size."""
        size = batch_size(self.call) // micro
        key = (size, shallow)
        if key not in self.by_size:
            copy = shallow and self.shallow is not None
            # blocks=: the model is a shallow stand-in already and its plans are never
            # lowered, so every size after the first comes from one symbolic-batch
            # capture too (it prices exactly as an export at that size)
            cap = self._any_batch(size) if copy else \
                self._any_batch(size, self.model) if self.opts.blocks is not None else None
            if cap is None:
                model = self.shallow[0] if copy else self.model
                report(f"capturing the model{f' ({KEEP} layers)' if shallow else ''} at "
                       f"micro-batch size {size}")
                cap = capture(model, *micro_inputs(self.call, micro), precision=self.opts.precision)
            t0 = time.perf_counter()
            annotate(cap.gm)
            self.by_size[key] = cap
            self.timings["capture"] = self.timings.get("capture", 0.0) + cap.seconds
            self.timings["annotate"] = self.timings.get("annotate", 0.0) + time.perf_counter() - t0
        return self.by_size[key]

    def _any_batch(self, size: int, model: nn.Module | None = None) -> Captured | None:
        """The shallow copy (or ``model``: the user's, under ``blocks=``) at batch ``size``
        from its one symbolic-batch capture (:mod:`autopar.capture.batch`), or ``None``:
        then it is exported at that size.  The shallow copy's are estimates only: the
        chosen split is exported at full depth at its own size; a ``blocks=`` plan is
        never lowered.  The first size is exported as it is (the symbolic export costs
        ~2.5 of those, and a search that is not short of memory never prices a second
        size)."""
        if not any(shallow == (model is None) for _, shallow in self.by_size):
            return None
        if self.generic is None:
            report(f"capturing the model{f' ({KEEP} layers)' if model is None else ''} once for "
                   "every micro-batch size")
            # traced at the whole batch: the size asked for may be 1, which export fixes
            t0 = time.perf_counter()
            self.generic = capture_any_batch(model if model is not None else self.shallow[0],
                                             self.call, self.opts.precision) or False
            # capture time, as any export (a failed attempt too: not the search's)
            self.timings["capture"] = self.timings.get("capture", 0.0) + time.perf_counter() - t0
        if not self.generic:
            return None
        cap = self.generic.at(size)
        if cap is not None:
            report(f"the model{f' ({KEEP} layers)' if model is None else ''} at micro-batch size {size} from that capture "
                   f"({cap.seconds:.2f} s)")
        return cap

    def start_early(self) -> bool:
        """Estimate every candidate, the plain one included, from a copy of the model
        with its layer list cut to :data:`KEEP` layers (:mod:`autopar.search.shallow`), so that
        only the chosen split is captured at full depth; True when on.  Not when the
        user's options name layers of that list (a pin, ``recompute=``), nor for
        ``blocks=`` (the model is shallow already)."""
        if self.shallow is not None and not self.exact:
            return True  # shared by another search of the same model (share)
        found = None if self.exact or self.opts.blocks is not None else repeated_list(self.model)
        if found is None:
            return False
        path, depth = found
        # only input pins and globs over parameters that name no layer index: a pin on a
        # node or on layer 7 would name nothing in the copy
        indexed = re.compile(rf"(^|[.*]){re.escape(path)}\.\d")
        named = bool(self.opts.recompute) or any(
            not (str(k).startswith("input:") or ("*" in str(k) and not indexed.search(str(k))))
            for k in self.opts.pins)
        model = None if named else shallow_copy(self.model, path)
        if model is None:
            return False
        self.shallow = (model, depth, path)
        return True

    def start_shallow(self, plain: list[LayerStat] | None) -> bool:
        """Estimate the candidates to come from a shallow copy when the plain candidate's
        repeated layers (``plain``, its layer statistics; ``None`` before it is priced)
        are identical (:mod:`autopar.search.shallow`); True when on."""
        if self.exact or self.opts.blocks is not None or plain is None:
            return False  # blocks=: the user's model is shallow already
        found = homogeneous(plain)
        model = shallow_copy(self.model, found[0]) if found else None
        if model is None:
            return False
        self.shallow = (model, found[1], found[0])
        return True


def request(gm: fx.GraphModule, micro_batches: int, mesh_shape: list[int],
            budget: float) -> Request:
    """The plan's :class:`~autopar.plans.Request` from the graph captured at the
    micro-batch size: tokens are read from the first integer input of two or more dims
    (token ids: batch x sequence), FLOPs from the annotated ops (x3: forward + backward)."""
    tokens = 0
    for n in gm.graph.nodes:
        if n.op != "placeholder" or info(n).param or info(n).buffer or len(info(n).outputs) != 1:
            continue
        t = info(n).out
        if t.ndim >= 2 and not t.dtype.is_floating_point and not t.dtype.is_complex \
                and t.dtype != torch.bool:
            tokens = t.shape[0] * t.shape[1] * micro_batches
            break
    flops = sum(info(n).flops for n in gm.graph.nodes if n.op == "call_function")
    return Request(mesh_shape=mesh_shape, memory_budget_bytes=float(budget), tokens_per_step=tokens,
                   model_flops_per_step=3.0 * flops * micro_batches)



__all__ = ["Captures", "request"]
