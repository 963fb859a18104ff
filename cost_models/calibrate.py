"""Measure a :class:`~autopar.cost_models.mesh.MeshSpec` on the running cluster.

:func:`measure_cluster` (and :func:`calibrate`, its MeshSpec) runs on every rank of an
initialised ``torch.distributed`` group, on the job that will train:

- per mesh axis and per collective kind (all-reduce, all-gather, reduce-scatter,
  all-to-all, send/recv), a latency-bandwidth curve over message sizes with repetitions
  and spread, and each kind's ``(alpha, beta)`` fitted in that kind's own formula
  (:func:`fit_alpha_beta`): the link's own numbers are the all-reduce's, the others go to
  ``LinkSpec.kinds`` (so gloo's reduce-scatter, which costs an all-reduce, is priced as
  one);
- matmul throughput over several sizes, alone and as a training layer's two Linear layers
  forward and backward (the rate planned with), the bandwidth a layer's norm and
  activation reach forward and backward in the cost model's terms (``mem_bandwidth``),
  copy bandwidth and a tiny kernel's time, with every rank computing at once (ranks
  that share cores get their share, as in training);
- the optimizer step's bytes/s and its time per parameter tensor (foreach AdamW steps,
  each after a training layer's forward and backward), ``overlap`` fitted to a
  collective run beside compute (:func:`~autopar.cost_models.measure_sync.overlap_fraction`)
  and ``idle_reuse``, how much of a pipeline bubble ranks sharing cores win back
  (:func:`~autopar.cost_models.measure_sync.idle_reuse`);
- ``straggler``, the slowest rank's compute time over the ranks' mean for a step-long
  window (:func:`~autopar.cost_models.measure_sync.straggler`), and ``sync_seconds``, what a
  blocking collective issued between compute costs beyond its price after a barrier
  (:func:`~autopar.cost_models.measure_sync.sync_penalty`).

Every timing is all-reduced (MAX for collectives, which the slowest rank paces; the mean
for compute rates) before anything is derived from it, so every rank returns the
identical MeshSpec and plans the same.  :class:`Calibration` keeps what was
measured, when, on which host and how noisy; its JSON is a MeshSpec JSON that
``--mesh-json`` and ``MeshSpec.from_json`` read (they skip the ``"calibration"`` record).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .link import LinkSpec
from .measure import (
    Sample,
    collective_samples,
    compute_rates,
    max_over_ranks,
    optimizer_rates,
)
from .measure_sync import collective_pairing, idle_reuse, overlap_fraction, straggler, sync_penalty
from .mesh import MeshSpec

__all__ = ["FITTED_KINDS", "Calibration", "calibrate", "fit_alpha_beta", "kind_coefficients",
           "measure_cluster"]

FITTED_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                 "send_recv")
"""The collective kinds calibration measures (broadcast keeps the all-reduce's link)."""


def kind_coefficients(kind: str, p: int) -> tuple[float, float]:
    """``(c_alpha, c_beta)`` of ``kind`` on ``p`` ranks: its time is ``c_alpha * alpha +
    c_beta * S / beta`` (the ring formulas of :mod:`~autopar.cost_models.collective_costs`)."""
    if kind == "all_reduce":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(p - 1), (p - 1) / p
    if kind == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"no fitted formula for collective kind {kind!r}")


def fit_alpha_beta(p: int, sizes: Sequence[float], times: Sequence[float],
                   kind: str = "all_reduce") -> tuple[float, float]:
    """Fit ``(alpha, beta)`` of ``kind``'s ring formula to measured ``times`` at ``sizes``.

    Fits ``t = a + b * S`` by least squares weighted by ``1 / t`` (relative error, so the small
    sizes that carry the latency are not swamped by the large ones), then
    ``alpha = a / c_alpha`` and ``beta = c_beta / b`` (:func:`kind_coefficients`). Noise can
    make ``a`` or ``b`` non-positive; the fit then falls back to the one-parameter model and
    finally to conservative bounds, so both results are always positive and finite.
    """
    if p < 2:
        raise ValueError(f"fit_alpha_beta needs p >= 2 ranks, got {p}")
    if len(sizes) != len(times) or not sizes:
        raise ValueError("sizes and times must be non-empty and of equal length")
    if any(not math.isfinite(t) or t <= 0 for t in times) or any(s <= 0 for s in sizes):
        raise ValueError(f"sizes and times must be positive and finite, got {sizes}, {times}")
    ca, cb = kind_coefficients(kind, p)
    w = [1.0 / t for t in times]
    # Weighted normal equations for t = a + b x with weights w^2 on the squared residuals.
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, x in zip(w, sizes))
    sxx = sum(wi * wi * x * x for wi, x in zip(w, sizes))
    st = sum(wi * wi * t for wi, t in zip(w, times))
    sxt = sum(wi * wi * x * t for wi, x, t in zip(w, sizes, times))
    det = sw * sxx - sx * sx
    a, b = (-1.0, -1.0) if det <= 0 else ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det)
    if a <= 0 or b <= 0:
        # One of the two terms is not visible above the noise; fit the other alone.
        if b > 0:
            a, b = 0.0, sxt / sxx
        else:
            a, b = st / sw, 0.0
    # A term the data could not resolve is bounded by what the extreme sample allows.
    i_small = min(range(len(sizes)), key=lambda i: sizes[i])
    i_large = max(range(len(sizes)), key=lambda i: sizes[i])
    if b <= 0:
        b = times[i_large] / sizes[i_large]
    if a <= 0:
        # Small positive residual: 1% of the smallest message's time, so alpha stays > 0.
        a = 0.01 * times[i_small]
    return a / ca, cb / b


@dataclass
class Calibration:
    """A measured MeshSpec and the measurements behind it.

    ``curves`` maps ``"axis<i>/<kind>"`` to its samples (bytes, median seconds, spread)
    with the fitted formula's time beside each; ``compute`` holds the matmul rate per size
    and the copy and tiny-kernel numbers; ``overlap`` the three times the overlap was fitted
    to.  ``noise`` is the median spread of all collective samples."""

    spec: MeshSpec
    curves: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    compute: dict[str, Any] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)
    optimizer_bandwidth: float = 0.0
    when: str = ""
    host: str = ""
    backend: str = ""
    world: int = 1
    repeats: int = 0
    seconds: float = 0.0
    quick: bool = False
    """Measured with ``measure_cluster(quick=True)``, as ``auto_parallel`` does by default."""

    @property
    def noise(self) -> float:
        """Median of every collective sample's spread (interquartile range / median)."""
        spreads = sorted(s["spread"] for ss in self.curves.values() for s in ss)
        return spreads[len(spreads) // 2] if spreads else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The MeshSpec's dict with a ``"calibration"`` record added."""
        d = self.spec.to_dict()
        d["calibration"] = {
            "when": self.when, "host": self.host, "backend": self.backend, "world": self.world,
            "repeats": self.repeats, "seconds": self.seconds, "quick": self.quick, "noise": self.noise,
            "curves": self.curves, "compute": self.compute, "overlap": self.overlap,
            "optimizer_bandwidth": self.optimizer_bandwidth,
        }
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """JSON text of :meth:`to_dict`; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def _overlap_rounds(self) -> str:
        """`` (rounds' median M +- E)`` behind the overlap, where the record has them
        (:func:`~autopar.cost_models.measure_sync.overlap_estimate`; older records do not)."""
        ov = self.overlap
        if "median" not in ov or "stderr" not in ov:
            return ""
        return f" (rounds' median {ov['median']:.2f} +- {ov['stderr']:.2f})"

    def table(self) -> str:
        """The measurements in a few lines of text (one per curve)."""
        s = self.spec
        # the curve's rates, smallest kernels first
        mm = "/".join(f"{r / 1e9:.0f}" for _, r in s.matmul_curve) or f"{s.peak_flops / 1e9:.1f}"
        lines = [f"calibrated {self.world} ranks ({self.backend}{', quick' if self.quick else ''}) "
                 f"on {self.host} at {self.when} "
                 f"in {self.seconds:.1f} s; median spread {100 * self.noise:.0f}%",
                 f"  matmul {mm} GFLOP/s, elementwise {s.mem_bandwidth / 1e9:.1f} GB/s "
                 f"(copy {self.compute.get('copy_bandwidth', s.mem_bandwidth) / 1e9:.1f}), "
                 f"kernel {s.kernel_floor * 1e6:.1f} us, optimizer {self.optimizer_bandwidth / 1e9:.2f} GB/s "
                 f"+ {s.optimizer_tensor_seconds * 1e6:.1f} us per tensor, "
                 f"overlap {s.overlap:.2f}{self._overlap_rounds()}, idle reuse {s.idle_reuse:.2f}, "
                 f"straggler {s.straggler:.2f}, sync {s.sync_seconds * 1e3:.2f} ms per blocking collective"]
        for name, samples in self.curves.items():
            pts = ", ".join(f"{x['nbytes'] / 1024:g} KiB {x['seconds'] * 1e3:.2f} ms "
                            f"(fit {x['fitted'] * 1e3:.2f}, spread {100 * x['spread']:.0f}%)"
                            for x in samples)
            lines.append(f"  {name}: {pts}")
        return "\n".join(lines)


def _host_memory_bytes() -> float:
    """Physical memory of this host divided among the ranks on it (LOCAL_WORLD_SIZE or 1)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
        total = 8 * 2**30
    return float(total) / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _unmeasured(base: MeshSpec | None, cuda: bool, capacity: float) -> dict[str, Any]:
    """What calibration does not measure, from ``base``, else from the presets for this
    kind of device (GPU or CPU host): the memory reserve (calibration measures capacity,
    not what the runtime spends outside the plan's tensors; at most half of
    ``capacity``, since a small host shared by many ranks must still leave the plan
    something) and the collectives the backend runs as flat rings (NCCL's all-gather and
    reduce-scatter over several measured axes) and the zero-bubble split's factor
    (``MeshSpec.split_backward``: one layer's probes scatter too widely to plan with)."""
    ref = base if base is not None else MeshSpec.preset("8xH100-nvlink" if cuda else "cpu-gloo")
    fixed = min(ref.reserve_bytes, 0.5 * capacity * (1.0 - ref.reserve_fraction))
    # host memory for offload: a GPU rank's share of this host's RAM (less 10% for the
    # processes), a CPU rank's is its device memory; the link and sockets as the preset's
    host = 0.9 * _host_memory_bytes() if cuda else capacity
    return {"reserve_bytes": fixed, "reserve_fraction": ref.reserve_fraction,
            "flat_ring": ref.flat_ring, "split_backward": ref.split_backward,
            "host_memory": host, "host_bandwidth": ref.host_bandwidth,
            "host_mem_bandwidth": ref.host_mem_bandwidth}


def _axis_groups(group: Any, shape: tuple[int, ...] | None, device_type: str) -> list[Any]:
    """One process group per mesh axis containing this rank (``group`` for a 1-D mesh)."""
    if shape is None or len(shape) == 1:
        return [group]

    if group is not None:
        raise ValueError("calibrate(): give either group (1-D) or shape, not both")
    mesh = init_device_mesh(device_type, tuple(shape))
    return [mesh.get_group(i) for i in range(len(shape))]


def _link(kind_samples: dict[str, list[Sample]], p: int,
          out: dict[str, list[dict[str, float]]], prefix: str) -> LinkSpec:
    """The axis' LinkSpec from its curves; each sample's fitted time goes into ``out``."""
    fits = {}
    for kind, samples in kind_samples.items():
        sizes = [float(s.nbytes) for s in samples]
        times = [s.seconds for s in samples]
        a, b = fit_alpha_beta(p, sizes, times, kind)
        fits[kind] = (a, b)
        ca, cb = kind_coefficients(kind, p)
        out[f"{prefix}/{kind}"] = [{"nbytes": s.nbytes, "seconds": s.seconds, "spread": s.spread,
                                    "fitted": ca * a + cb * s.nbytes / b} for s in samples]
    alpha, beta = fits.pop("all_reduce")
    return LinkSpec(alpha=alpha, beta=beta, kinds=tuple((k, a, b) for k, (a, b) in fits.items()))


@dataclass(frozen=True)
class _Device:
    """Where and at what sizes this rank measures: its device and dtype, the compute
    probes' sizes and least run time, the default message sizes, and ``sync`` (waits
    for the device's queued work; nothing to wait for on CPU)."""

    cuda: bool
    device: Any
    dtype: Any
    mm_sizes: tuple[int, ...]
    copy_bytes: int
    opt_elems: int
    min_s: float
    default_sizes: tuple[int, ...]
    sync: Any

    @property
    def mid(self) -> int:
        """The middle matmul width, the one the sync probes compute with."""
        return self.mm_sizes[len(self.mm_sizes) // 2]

    @property
    def tokens(self) -> int:
        """Rows of a training layer's probe."""
        return 4096 if self.cuda else 512


def _device(cuda: bool, quick: bool) -> _Device:
    """The :class:`_Device` for this rank (a third of each rate's run time when ``quick``)."""
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())

        def sync() -> None:
            torch.cuda.synchronize(device)

        d = _Device(True, device, torch.bfloat16, (2048, 4096, 8192), 2**28, 2**26, 0.2,
                    (2**16, 2**20, 2**24, 2**26), sync)
    else:
        def sync() -> None:
            pass

        # Small enough to keep a CPU calibration to a few seconds per rank.
        d = _Device(False, torch.device("cpu"), torch.float32, (128, 256, 512), 2**25, 2**20, 0.25,
                    (2**12, 2**16, 2**20, 2**22), sync)
    if quick:
        d = dataclasses.replace(d, min_s=d.min_s / 3)
    return d


def _checked_kinds(repeats: int, kinds: Sequence[str]) -> tuple[str, ...]:
    """The kinds to measure, all-reduce first; raises on bad ``repeats`` or ``kinds``."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    unknown = set(kinds) - set(FITTED_KINDS)
    if unknown:
        raise ValueError(f"calibrate(): unknown kinds {sorted(unknown)}; known: {FITTED_KINDS}")
    return ("all_reduce", *[k for k in FITTED_KINDS if k in kinds and k != "all_reduce"])


def _links(groups: list[Any], dims: tuple[int, ...], base: MeshSpec | None, kinds: tuple[str, ...],
           sizes: tuple[int, ...], repeats: int, dev: _Device, group: Any,
           curves: dict[str, list[dict[str, float]]]) -> list[LinkSpec]:
    """Each mesh axis' LinkSpec from its collective curves (recorded in ``curves``)."""
    known = (base or MeshSpec.preset("cpu-gloo")).links
    links = []
    for i, (g, p) in enumerate(zip(groups, dims)):
        if p < 2:
            # an axis of one rank talks to nobody: keep base's numbers for it, flat (a
            # hierarchical link's group cannot divide one rank)
            f = known[min(i, len(known) - 1)]
            links.append(LinkSpec(alpha=f.alpha, beta=f.beta, kinds=f.kinds))
            continue
        samples = {k: collective_samples(k, g, sizes, repeats, dev.device, dev.sync, job=group)
                   for k in kinds}
        links.append(_link(samples, p, curves, f"axis{i}"))
    return links


@dataclass(frozen=True)
class _SyncProbes:
    """What ranks waiting on one another cost: each probe's record (see the module
    docstring)."""

    overlap: dict
    straggler: dict
    sync: dict
    pairing: dict
    reuse: dict


def _sync_probes(group: Any, axis_group: Any, ranks: int, world: int, sizes: tuple[int, ...],
                 dev: _Device, repeats: int, quick: bool) -> _SyncProbes:
    """Overlap, straggler, drift, twin-collective pairing and idle reuse, measured on
    ``axis_group`` (the widest axis, of ``ranks`` ranks) or the whole job.  The three
    that scale with ``repeats`` run fixed rounds when ``quick``."""
    rounds = {"overlap": 9, "straggler": 10, "sync": 10} if quick else \
        {"overlap": 3 * repeats, "straggler": 9 * repeats, "sync": 12 * repeats}
    # three times the repetitions (9 rounds quick): the fraction is a difference of times a few ms long, and
    # at 5 it came out anywhere in 0.02-0.39 on the 2-core host (the median of 15: 0.12-0.47
    # in 4 of 10 on 2026-11-25, hence overlap_estimate's bound of two standard errors)
    ov = overlap_fraction(axis_group, max(sizes), dev.device, dev.dtype, dev.mid, rounds["overlap"],
                          dev.sync, job=group) if ranks > 1 else {"overlap": 1.0}
    # over the whole job: a straggler exists only where ranks wait on one another, so a
    # 1-rank job has none.  Nine times the repetitions (45 windows, about 5 s on CPU; 10 quick): it
    # multiplies every compute price, and over 15 windows eight estimates a few seconds
    # apart on the 2-core host spanned 1.07-1.28, over 45 1.12-1.22 (2026-11-26)
    lag = straggler(group, dev.device, dev.dtype, dev.mid, dev.tokens, rounds["straggler"],
                    dev.sync) if world > 1 else {"straggler": 1.0}
    # twelve times the repetitions (60 rounds, 12-18 s on CPU; 10 quick): a round's drift varies by
    # 4-6 ms (one standard deviation) on the 2-core host with one more busy process, and
    # over 15 rounds six calibrations of it spanned 1.2-8.8 ms, over 60 4.4-6.3
    # (2026-11-26).  The drift beyond the ranks' mean compute, not beyond the
    # straggler's share of it (sync_penalty says why)
    sync_extra = sync_penalty(axis_group, dev.device, dev.dtype, dev.mid, rounds["sync"], dev.sync,
                              job=group, chain=4) if ranks > 1 else {"sync_seconds": 0.0}
    # twin collectives in flight at once (multi-copy overlap): 21 rounds, 9 quick, of 16
    # pairs each (about a second on 4 gloo ranks here)
    pairing = collective_pairing(axis_group, dev.device, 9 if quick else 21, dev.sync, job=group) \
        if ranks > 1 else {"collective_pairing": 0.0}
    # a GPU per rank: an idle stage's device is lost, whatever noise the rates show
    reuse = {"idle_reuse": 0.0} if dev.cuda else \
        idle_reuse(group, dev.device, dev.dtype, dev.mid, dev.min_s, dev.sync)
    return _SyncProbes(ov, lag, sync_extra, pairing, reuse)


def _capacity(base: MeshSpec | None, dev: _Device, group: Any) -> float:
    """Device memory: ``base``'s, else the device's (a CPU rank's share of the host),
    the MIN over ranks (a negated MAX) so every rank plans for the smallest device."""
    if base is not None:
        capacity = base.mem_capacity
    elif dev.cuda:
        capacity = float(torch.cuda.get_device_properties(dev.device).total_memory)
    else:
        capacity = _host_memory_bytes()
    return -max_over_ranks([-capacity], group, dev.device)[0]


def measure_cluster(group: Any = None, sizes: Sequence[int] | None = None, repeats: int = 5,
                    base: MeshSpec | None = None, shape: Sequence[int] | None = None,
                    kinds: Sequence[str] = FITTED_KINDS, quick: bool = False) -> Calibration:
    """Measure the running group; see the module docstring.  Every rank calls it alike.

    ``group`` (default the world) is a 1-D mesh; ``shape`` (product = world size) measures
    each axis of that mesh over its own groups, all of an axis' groups at once.
    ``sizes`` are message bytes (default 4 KiB-4 MiB on CPU, 64 KiB-64 MiB on GPU),
    ``repeats`` the repetitions per point, ``kinds`` a subset of :data:`FITTED_KINDS`
    (all-reduce is always measured).  ``base`` supplies what cannot be measured here
    (``mem_capacity``) and the link of an axis of one rank.

    ``quick=True`` is the calibration ``auto_parallel`` runs by default (about 10 s on 4
    ranks of a 2-core CPU host against 28 s): a third of each rate's run time and fixed
    rounds for the three probes that scale with ``repeats`` here (overlap 9 rounds,
    straggler 10 windows, drift 10 rounds, against 15, 45 and 60 at ``repeats=5``);
    their estimates are noisier (see each probe's count below), which the cache
    (:mod:`~autopar.cost_models.live`) pays once per cluster.  The collective curves
    keep every size and ``repeats`` (0.8 s of the 28 at 5): with three sizes at 3
    repetitions one slow 4 MiB sample set a run's bandwidth 1.4-1.8x below the others'
    (2026-11-28) and its predicted steps 25% over the measured ones."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("calibrate() needs an initialised torch.distributed process group")
    kinds = _checked_kinds(repeats, kinds)
    t_start = time.perf_counter()
    dev = _device(dist.get_backend(group) == "nccl", quick)
    sizes = tuple(dev.default_sizes if sizes is None else sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in sizes):
        raise ValueError(f"sizes must be non-empty ints >= 4 bytes, got {sizes!r}")
    world = dist.get_world_size(group)
    dims = (world,) if shape is None else MeshSpec.parse_shape(tuple(shape))
    if math.prod(dims) != world:
        raise ValueError(f"calibrate(): shape {dims} has {math.prod(dims)} ranks, the group {world}")
    groups = _axis_groups(group, dims, dev.device.type)
    curves: dict[str, list[dict[str, float]]] = {}
    links = _links(groups, dims, base, kinds, sizes, repeats, dev, group, curves)
    rates = compute_rates(group, dev.device, dev.dtype, dev.mm_sizes, dev.copy_bytes, dev.min_s,
                          dev.sync, tokens=dev.tokens)
    opt = optimizer_rates(group, dev.device, dev.opt_elems, dev.min_s, dev.sync, tokens=dev.tokens,
                          dtype=dev.dtype)
    widest = max(range(len(dims)), key=lambda i: dims[i])
    pr = _sync_probes(group, groups[widest], dims[widest], world, sizes, dev, repeats, quick)
    capacity = _capacity(base, dev, group)
    spec = MeshSpec(shape=dims, axis_names=(), links=tuple(links),
                    peak_flops=rates["peak_flops"], mem_bandwidth=rates["mem_bandwidth"],
                    matmul_curve=tuple(rates["matmul_curve"]),
                    mem_capacity=capacity, flops_efficiency=1.0, name="calibrated",
                    kernel_floor=rates["kernel_floor"], overlap=pr.overlap["overlap"],
                    optimizer_bandwidth=opt["bandwidth"], optimizer_tensor_seconds=opt["tensor_seconds"],
                    idle_reuse=pr.reuse["idle_reuse"], sync_seconds=pr.sync["sync_seconds"],
                    sync_window=pr.sync.get("chunk", 0.0),
                    straggler=pr.straggler["straggler"],
                    collective_pairing=pr.pairing["collective_pairing"],
                    # the base preset's reserve and flat rings, else the preset kind's
                    **_unmeasured(base, dev.cuda, capacity))
    elapsed = max_over_ranks([time.perf_counter() - t_start], group, dev.device)[0]
    return Calibration(
        spec=spec, curves=curves, overlap=pr.overlap,
        compute={**rates, "idle_reuse": pr.reuse, "optimizer": opt, "sync": pr.sync,
                 "straggler": pr.straggler},
        optimizer_bandwidth=opt["bandwidth"],
        when=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(), backend=str(dist.get_backend(group)), world=world,
        repeats=repeats, seconds=elapsed, quick=quick)


def calibrate(group: Any = None, sizes: Sequence[int] | None = None, repeats: int = 5,
              base: MeshSpec | None = None, shape: Sequence[int] | None = None) -> MeshSpec:
    """The MeshSpec :func:`measure_cluster` measures, named ``"calibrated"``.

    ``matmul_curve`` is the rate of a training layer's two Linear layers (forward and
    backward, autograd included) per width, by FLOPs per kernel, with every rank
    computing (fp32 on CPU, bf16 on CUDA), ``peak_flops`` its fastest and
    ``flops_efficiency = 1.0``, since it already is what real kernels reach;
    ``mem_bandwidth`` the median over widths of what the layer's LayerNorm and GELU reach
    forward and backward, in the bytes the cost model prices them by; ``kernel_floor`` a
    tiny kernel's time; ``optimizer_bandwidth`` and ``optimizer_tensor_seconds`` a real
    AdamW step's after a training layer's backward;
    ``overlap`` fitted in the bucket model's terms.  A single-rank group measures no link and
    keeps ``base``'s link, or the cpu-gloo preset's."""
    return measure_cluster(group, sizes, repeats, base, shape).spec
