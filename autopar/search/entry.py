"""The search's entry point: one mesh's joint search (:mod:`autopar.search.joint`), or
the mesh shape searched from a device count (:mod:`autopar.search.mesh_shapes`)."""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from autopar.capture.trace import Captured
from autopar.cost_models import MeshSpec
from autopar.errors import AutoparWarning, NoFitError, user_stacklevel
from autopar.plans.data import Plan
from autopar.plans.decisions import PlanOptions
from autopar.search.joint import JointSearch
from autopar.search.mesh_shapes import ShapeSearch
from autopar.search.node_prices import precision_warning

__all__ = ["joint_plan"]


def joint_plan(model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
               example_kwargs: dict | None = None) -> tuple[Captured, Plan]:
    """Run :class:`~autopar.search.joint.JointSearch`, or
    :class:`~autopar.search.mesh_shapes.ShapeSearch` when only the device count is given
    (``mesh.search_shape``); warnings raised while planning are kept on the plan."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _search(model, example_inputs, mesh, opts, example_kwargs)
        try:
            cap, p = first.run()
        except NoFitError as e:
            # nothing fits the devices: weigh host offload unless the user ruled on it
            # (or the mesh does not say how much host memory there is)
            if opts.offload is not None or mesh.host_memory is None:
                raise
            try:
                cap, p = _search(model, example_inputs, mesh, dataclasses.replace(opts, offload="auto"),
                                 example_kwargs, first).run()
            except NoFitError as again:
                raise NoFitError(f"{again}, host offload considered too (without it: {e})") from None
            p.decisions.why["offload"] = "nothing fits the devices without offload; " + \
                p.decisions.why.get("offload", "")
    for w in caught:
        if str(w.message) not in p.warnings:
            p.warnings.append(str(w.message))
    slow = precision_warning(cap.gm, p.mesh, opts.precision)
    if slow:
        p.warnings.append(slow)
    for msg in p.warnings:  # shown with every plan, not once per process
        warnings.warn(msg, AutoparWarning, stacklevel=user_stacklevel())
    return cap, p


def _search(model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
            example_kwargs: dict | None, after: JointSearch | ShapeSearch | None = None):
    """The search for ``mesh`` (its shape searched when only a device count is given);
    ``after``: an earlier search of the same model and call whose captures it reuses
    (the retry with offload captures nothing again)."""
    if mesh.search_shape:
        base = next(iter(after.searches.values()), None) if after is not None else None
        return ShapeSearch(model, example_inputs, mesh, opts, example_kwargs, base=base)
    search = JointSearch(model, example_inputs, mesh, opts, example_kwargs)
    if after is not None:
        search.share(after)
    return search
