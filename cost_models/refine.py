"""Learn from measured steps: scale a MeshSpec's compute and communication prices so the
steps :func:`autopar.verify` measured (``store=``, ``autopar check --store``) are
predicted as they ran.

Each stored row has the predicted step split into compute, exposed communication, the
pipeline bubble and the optimizer step (``plan.decisions.breakdown``) and the measured
step.  Rows priced with the mesh being refined are fitted by non-negative least squares,
relative error weighted::

    measured ~ a * compute + b * exposed_comm + bubble + optimizer

and the mesh comes back with compute ``a`` times slower (``peak_flops`` and
``fp32_peak_flops`` divided by ``a``) and every link ``b`` times slower (each ``alpha``
times ``b``, each ``beta`` divided by ``b``, per kind and across levels), so plans priced
with it see the machine as the measurements did.  The bubble and the optimizer are kept:
they are small beside the two, and a fit with four free scales from a handful of plans
would chase the noise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .link import LinkSpec
from .mesh import MeshSpec

__all__ = ["Refinement", "fit_scales", "read_rows", "refine", "scale_link"]


@dataclass(frozen=True)
class Refinement:
    """The refined mesh, the scales fitted and the rows they came from."""

    spec: MeshSpec
    compute_scale: float
    comm_scale: float
    rows: int
    error_before: float
    """Median relative error of the rows' predictions before refining."""
    error_after: float
    """The same with the fitted scales."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of a measurements file (``verify(store=...)``); a line that is not
    JSON is a ValueError naming the file and line."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    return rows


def _terms(row: Mapping[str, Any]) -> tuple[float, float, float, float]:
    """(compute, exposed comm, fixed rest, measured) of one stored row."""
    b = row["predicted_breakdown"]
    fixed = b.get("bubble_seconds", 0.0) + b.get("optimizer_seconds", 0.0)
    return (b.get("compute_seconds", 0.0), b.get("exposed_comm_seconds", 0.0), fixed,
            float(row["measured_seconds"]))


def fit_scales(rows: Iterable[Mapping[str, Any]]) -> tuple[float, float]:
    """``(a, b)`` >= 0 minimising ``sum ((a c + b x + f - m) / m)^2`` over the rows (compute
    ``c``, exposed communication ``x``, fixed rest ``f``, measured ``m``): the 2x2 normal
    equations, or one scale alone when the other would come out negative (non-negative
    least squares in two variables).  A scale no row informs (its term is 0 everywhere)
    stays 1."""
    t = [_terms(r) for r in rows]
    if not t:
        raise ValueError("no measured rows to learn from")
    # weights 1/m: relative error, so a fast plan counts as much as a slow one
    w = [1.0 / m for *_, m in t]
    cc = sum((wi * c) ** 2 for wi, (c, _, _, _) in zip(w, t))
    xx = sum((wi * x) ** 2 for wi, (_, x, _, _) in zip(w, t))
    cx = sum(wi * wi * c * x for wi, (c, x, _, _) in zip(w, t))
    cy = sum(wi * wi * c * (m - f) for wi, (c, _, f, m) in zip(w, t))
    xy = sum(wi * wi * x * (m - f) for wi, (_, x, f, m) in zip(w, t))
    if cc == 0 and xx == 0:
        return 1.0, 1.0
    if xx == 0:
        return max(0.0, cy / cc), 1.0
    if cc == 0:
        return 1.0, max(0.0, xy / xx)
    det = cc * xx - cx * cx
    if det > 1e-12 * cc * xx:
        a, b = (cy * xx - xy * cx) / det, (xy * cc - cy * cx) / det
        if a >= 0 and b >= 0:
            return a, b
    # the joint optimum leaves the quadrant (or the terms are collinear): the better of
    # the two one-scale fits with the other term at its floor 0
    only_a = (max(0.0, cy / cc), 0.0)
    only_b = (0.0, max(0.0, xy / xx))
    return min(only_a, only_b, key=lambda ab: _loss(t, w, *ab))


def _loss(t, w, a: float, b: float) -> float:
    return sum((wi * (a * c + b * x + f - m)) ** 2 for wi, (c, x, f, m) in zip(w, t))


def _median_error(t, a: float, b: float) -> float:
    errs = sorted(abs(a * c + b * x + f - m) / m for c, x, f, m in t)
    return errs[len(errs) // 2]


def scale_link(link: LinkSpec, b: float) -> LinkSpec:
    """``link`` ``b`` times slower: every latency times ``b``, every bandwidth over ``b``."""
    return replace(link, alpha=link.alpha * b, beta=link.beta / b,
                   kinds=tuple((k, a * b, bw / b) for k, a, bw in link.kinds),
                   inter=None if link.inter is None else scale_link(link.inter, b))


def refine(spec: MeshSpec, rows: Iterable[Mapping[str, Any]], min_rows: int = 3) -> Refinement:
    """``spec`` with compute and communication rescaled to the rows measured with it.

    Only rows whose ``mesh`` is ``spec`` (as a dict, reshaped plans included: the same
    machine numbers) count; fewer than ``min_rows`` is a ValueError, since two scales
    from fewer plans fit noise.  Scales are clamped to [0.1, 10]: a measurement an order
    of magnitude off says the rows come from another machine, not that it is slower."""
    mine = [r for r in rows if _same_machine(r.get("mesh", {}), spec)]
    if len(mine) < min_rows:
        raise ValueError(f"refine needs at least {min_rows} measured plans priced with this mesh "
                         f"({spec.name!r}), found {len(mine)}")
    t = [_terms(r) for r in mine]
    a, b = (min(10.0, max(0.1, s)) for s in fit_scales(mine))
    before = _median_error(t, 1.0, 1.0)
    after = _median_error(t, a, b)
    fp32 = None if spec.fp32_peak_flops is None else spec.fp32_peak_flops / a
    scaled = replace(spec, peak_flops=spec.peak_flops / a, fp32_peak_flops=fp32,
                     links=tuple(scale_link(link, b) for link in spec.links),
                     intra=None if spec.intra is None else scale_link(spec.intra, b),
                     inter=None if spec.inter is None else scale_link(spec.inter, b),
                     # the drift a blocking collective waits out is communication time too
                     sync_seconds=spec.sync_seconds * b, name=f"{spec.name}+refined")
    return Refinement(scaled, a, b, len(mine), before, after)


def _same_machine(d: Mapping[str, Any], spec: MeshSpec) -> bool:
    """Whether a stored mesh dict describes ``spec``'s machine (any shape or axis names)."""
    try:
        other = MeshSpec.from_dict(d)
    except (ValueError, TypeError, KeyError):
        return False
    keep = ("shape", "axis_names", "links")
    a = {k: v for k, v in other.to_dict().items() if k not in keep}
    b = {k: v for k, v in spec.to_dict().items() if k not in keep}
    # a preset derives its links from intra/inter (compared above); a calibrated mesh
    # reshaped for a plan reuses its measured links
    return a == b and (spec.intra is not None or set(other.links) <= set(spec.links))
