"""A scaling curve: the best plan for each of several device counts of one cluster.

:func:`scaling_curve` answers "how many GPUs?": for each count it searches the mesh
shape with everything else (:mod:`autopar.search.mesh_shapes`) and reports the best
plan's layout, predicted step, tokens/s (whole job and per device), MFU and memory, and
its efficiency against the smallest count.  Scaling is weak: the example batch is the
batch at the first count, and every other count gets the same rows per device.

To stay fast over many counts, the first count is planned whole (capture at full depth,
the chosen split confirmed) and the others from the shallow copy's estimates alone,
sharing its captures; each count gets ``time_limit / len(devices)`` seconds of search.
The FLOPs and tokens of a step scale with the batch, so the first count's full-depth
numbers give every count's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from torch import nn

from autopar.api import _options
from autopar.cost_models import MeshSpec, format_bytes
from autopar.errors import ConfigError
from autopar.plans.splits import batch_rows, batch_size
from autopar.report.summary import summary_numbers
from autopar.search.mesh_shapes import ShapeSearch

__all__ = ["ScalePoint", "draw_scaling", "scaling_curve", "scaling_json", "scaling_table"]


@dataclasses.dataclass(frozen=True)
class ScalePoint:
    """The best plan at one device count (``estimated``: from the shallow copy)."""

    devices: int
    shape: tuple[int, ...]
    batch: int
    layout: str
    step_seconds: float
    tokens_per_second: float
    mfu: float
    memory: float
    efficiency: float  # rows (so tokens) per second per device over the first count's
    estimated: bool
    note: str = ""

    @property
    def tokens_per_second_per_device(self) -> float:
        """Tokens/s over the device count."""
        return self.tokens_per_second / self.devices

    def to_dict(self) -> dict:
        """JSON form; an infinite step (no plan fits) is ``None``."""
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["tokens_per_second_per_device"] = self.tokens_per_second_per_device
        d["step_seconds"] = self.step_seconds if math.isfinite(self.step_seconds) else None
        return d


def scaling_curve(model: nn.Module, example_inputs: tuple | None = None, *, preset: str,
                  devices: Sequence[int], example_kwargs: dict | None = None,
                  time_limit: float = 30.0, **options) -> list[ScalePoint]:
    """The best plan of ``model`` on each count of ``devices`` of cluster ``preset`` (see
    the module docstring); ``options`` are :func:`autopar.plan`'s (``precision=``,
    ``batch=``, ``memory_budget=``, forced decisions)."""
    counts = list(devices)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ConfigError(f"devices={devices!r}: give one or more positive device counts")
    call = (tuple(example_inputs or ()), dict(example_kwargs or {}))
    b0 = batch_size(call)
    for n in counts:
        if b0 * n % counts[0]:
            raise ConfigError(f"the batch of {b0} at {counts[0]} devices scales to {b0 * n / counts[0]:g} "
                              f"rows at {n}: every count needs a whole number of rows")
    o = dict(options)
    budget, optimizer, pins = o.pop("memory_budget", None), o.pop("optimizer", "adamw"), o.pop("pins", None)
    search, batch = o.pop("search", "auto"), o.pop("batch", "global")
    opts = _options(budget, optimizer, time_limit / len(counts), pins, o, search, batch)
    points: list[ScalePoint] = []
    first = None
    per_row = (0.0, 0.0)  # FLOPs and tokens of one row of the batch, from the first count
    first_pace: float | None = None
    for n in counts:
        rows = b0 * n // counts[0]
        args, kwargs = batch_rows(call, rows)
        mesh = MeshSpec.preset(preset, devices=n)
        if first is None:
            search = ShapeSearch(model, args, mesh, opts, kwargs)
            _, p = search.run()
            first = next(iter(search.searches.values()))
            nums = summary_numbers(p)
            per_row = (nums["model_flops_per_step"] / rows, nums["tokens_per_step"] / rows)
            best = search.result(tuple(p.request.mesh_shape))
            best = dataclasses.replace(best, layout=nums["layout"], step_seconds=p.decisions.step_seconds,
                                       memory=p.memory.get("total", 0.0), estimated=False)
        else:
            # nothing planned at full depth here; rounds 1 and 2 get half the count's share
            # (for Llama-3 8B over 8-1,024 devices that finds the same plans as the whole
            # share, in less time)
            best = ShapeSearch(model, args, mesh, opts, kwargs, base=first, explore_share=0.5).explore()[0]
        step = best.step_seconds
        ok = math.isfinite(step) and step > 0
        tokens = per_row[1] * rows / step if ok else 0.0
        mfu = per_row[0] * rows / (step * n * mesh.peak_flops) if ok else 0.0
        # efficiency from rows/s per device: the tokens' ratio where there are tokens,
        # and defined for a model without token ids too
        pace = rows / step / n if ok else 0.0
        if first_pace is None:
            first_pace = pace
        points.append(ScalePoint(n, best.shape, rows, best.layout, step, tokens, mfu, best.memory,
                                 pace / first_pace if first_pace else 0.0, best.estimated,
                                 "" if ok else best.note))
    return points


def scaling_table(points: list[ScalePoint]) -> str:
    """The curve as an aligned text table."""
    head = (f"{'devices':>7}  {'mesh':>8}  {'step':>10}  {'tokens/s':>10}  {'per device':>10}  "
            f"{'MFU':>5}  {'memory':>9}  {'efficiency':>10}  layout")
    lines = [head]
    for p in points:
        if not math.isfinite(p.step_seconds):
            lines.append(f"{p.devices:>7}  {'-':>8}  {p.note}")
            continue
        lines.append(f"{p.devices:>7}  {'x'.join(map(str, p.shape)):>8}  {p.step_seconds * 1e3:>7.4g} ms  "
                     f"{p.tokens_per_second:>10,.0f}  {p.tokens_per_second_per_device:>10,.0f}  "
                     f"{p.mfu:>5.1%}  {format_bytes(p.memory):>9}  {p.efficiency:>10.2f}  {p.layout}"
                     + (" (est.)" if p.estimated else ""))
    return "\n".join(lines)


def scaling_json(points: list[ScalePoint]) -> str:
    """The curve as JSON text (a list of :meth:`ScalePoint.to_dict`)."""
    return json.dumps([p.to_dict() for p in points], indent=2)


def draw_scaling(points: list[ScalePoint], path: str) -> None:
    """Tokens/s per device and efficiency against the device count, as a PNG."""
    import matplotlib  # start-up: matplotlib costs ~1.2 s to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up: matplotlib costs ~1.2 s to import

    ok = [p for p in points if math.isfinite(p.step_seconds)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p.devices for p in ok], [p.tokens_per_second_per_device for p in ok], "o-", label="tokens/s per device")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens/s per device")
    ax2 = ax.twinx()
    ax2.plot([p.devices for p in ok], [p.efficiency for p in ok], "s--", color="tab:orange", label="efficiency")
    ax2.set_ylabel("efficiency vs the smallest count")
    ax2.set_ylim(0, max(1.1, max((p.efficiency for p in ok), default=1.0) * 1.1))
    for p in ok:
        ax.annotate("x".join(map(str, p.shape)), (p.devices, p.tokens_per_second_per_device),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    fig.legend(loc="lower left")
    ax.set_title("predicted scaling (weak: the same rows per device)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
