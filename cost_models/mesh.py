"""Device mesh description used by every cost formula: :class:`LinkSpec` and :class:`MeshSpec`.

A :class:`MeshSpec` is a logical mesh shape with one name per mesh axis, one :class:`LinkSpec`
(latency ``alpha`` in seconds, bandwidth ``beta`` in bytes/s) per mesh axis, and the per-device
roofline numbers (peak FLOP/s, memory bandwidth, memory capacity).

Presets describe a node (devices per node, the intra-node link, the inter-node link) and derive
the per-axis links for any shape. Ranks are laid out row-major, so the LAST mesh axis is the
fastest-varying one and is placed inside a node first::

    >>> m = MeshSpec.preset("multinode-a100-ib")          # shape (4, 8)
    >>> m.links[1] == m.intra, m.links[0] == m.inter       # 8 in a node, 4 nodes
    (True, True)
    >>> MeshSpec.preset("multinode-a100-ib", "16").links[0].group   # straddles 2 nodes
    8
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from os import PathLike
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch

from .link import LinkSpec, _check_int
from .presets import _PRESETS, PRESET_NAMES, _derive_links

__all__ = ["RANGES", "Interval", "MeshSpec"]


@dataclass(frozen=True)
class Interval:
    """The values a number field of :class:`MeshSpec` may take: between ``lo`` and
    ``hi``, each bound included or not; ``optional``: ``None`` too."""

    lo: float
    hi: float
    lo_in: bool = False
    hi_in: bool = False
    optional: bool = False

    def check(self, attr: str, v: Any) -> None:
        """Raise ValueError naming ``MeshSpec.attr`` unless ``v`` is in the interval."""
        if v is None and self.optional:
            return
        ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and (
            (self.lo <= v if self.lo_in else self.lo < v) and (v <= self.hi if self.hi_in else v < self.hi))
        if not ok:
            text = f"{'[' if self.lo_in else '('}{self.lo:g}, {self.hi:g}{']' if self.hi_in else ')'}"
            raise ValueError(f"MeshSpec.{attr} must be a number in {text}"
                             f"{' or None' if self.optional else ''}, got {v!r}")


_POSITIVE = Interval(0, math.inf)
_TIME = Interval(0, math.inf, lo_in=True)  # a duration or a byte count: 0 allowed
_FACTOR = Interval(1, math.inf, lo_in=True)  # a factor on a time: at least 1
_SHARE = Interval(0, 1, lo_in=True)  # a share of something, below all of it
RANGES: dict[str, Interval] = {
    "peak_flops": _POSITIVE, "mem_bandwidth": _POSITIVE, "mem_capacity": _POSITIVE,
    "flops_efficiency": Interval(0, 1, hi_in=True), "kernel_floor": _TIME,
    "overlap": Interval(0, 1, hi_in=True),
    "fp32_peak_flops": Interval(0, math.inf, optional=True),
    "optimizer_bandwidth": Interval(0, math.inf, optional=True), "optimizer_tensor_seconds": _TIME,
    "idle_reuse": _SHARE, "reserve_bytes": _TIME, "reserve_fraction": _SHARE,
    "straggler": _FACTOR, "sync_seconds": _TIME, "sync_window": _TIME, "split_backward": _FACTOR,
    "collective_pairing": Interval(0, 1, lo_in=True, hi_in=True),
    "host_bandwidth": Interval(0, math.inf, optional=True),
    "host_memory": Interval(0, math.inf, optional=True),
    "host_mem_bandwidth": Interval(0, math.inf, optional=True),
}
"""Every number field of :class:`MeshSpec` and what it may be (``__post_init__`` checks
them all; a test fails for a number field missing here)."""


def _default_axis_names(ndim: int) -> tuple[str, ...]:
    """``("a0", "a1", ...)``."""
    return tuple(f"a{i}" for i in range(ndim))


@dataclass(frozen=True)
class MeshSpec:
    """Logical device mesh: shape, axis names, a link per mesh axis, and device roofline numbers.

    ``peak_flops`` is per device in FLOP/s (GPU presets: dense bf16 tensor-core peak; cpu-gloo
    and calibrated meshes: fp32); ``fp32_peak_flops`` is the rate of fp32 (and fp64)
    kernels where it differs (GPUs: no tensor cores), None where one rate fits all dtypes
    (:meth:`peak_for`), ``mem_bandwidth`` in bytes/s, ``mem_capacity`` in bytes per
    device. ``flops_efficiency`` is the fraction of peak a real kernel reaches and
    ``kernel_floor`` the minimum time of any kernel in seconds. ``overlap`` is the fraction
    of its speed a collective keeps while the device computes (1.0: the link runs beside
    the kernels; below 1 where compute and communication share cores, as gloo does on a
    CPU host: 0.30-0.42 measured on this project's 2-core machine, 2 and 4 ranks, 1-8 MiB). ``optimizer_bandwidth`` is the bytes/s
    an optimizer step streams (:func:`~autopar.cost_models.compute.optimizer_step_time`;
    None: ``mem_bandwidth``) and ``optimizer_tensor_seconds`` what it spends per parameter
    tensor beyond that (a CPU's foreach kernels loop over the tensors; 0 on the presets).
    ``idle_reuse`` is the share of a
    pipeline bubble the other ranks win back: 0 on GPUs (an idle GPU is lost), about
    ``min(1, 2 (1 - K / R))`` where ``R`` ranks share ``K`` cores (an idle rank gives its
    core to the others, which then compute faster; from ``R = 2K`` on, the cores never
    idle), below 1 (at most 0.95 measured); calibration measures it. ``gpus_per_node``, ``intra`` and
    ``inter`` keep the node description of a preset so :meth:`with_shape` can re-derive links;
    ``gpus_per_node=None`` with ``intra`` set means one host without node boundaries.
    ``reserve_bytes`` and ``reserve_fraction`` (of ``mem_capacity``) are what a device
    spends outside the plan's tensors (runtime context, communication buffers, allocator
    fragmentation): the default memory budget is :attr:`usable_memory`.

    An empty ``axis_names`` tuple is replaced by the default names ``("a0", "a1", ...)``;
    lists are accepted for sequence fields and stored as tuples.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    links: tuple[LinkSpec, ...]
    peak_flops: float
    mem_bandwidth: float
    mem_capacity: float
    flops_efficiency: float = 0.6
    kernel_floor: float = 5e-6
    name: str = "custom"
    gpus_per_node: int | None = None
    intra: LinkSpec | None = None
    inter: LinkSpec | None = None
    overlap: float = 1.0
    fp32_peak_flops: float | None = None
    optimizer_bandwidth: float | None = None
    optimizer_tensor_seconds: float = 0.0
    matmul_curve: tuple[tuple[float, float], ...] = ()
    """``(FLOPs of one kernel, FLOP/s it reaches)`` in increasing FLOPs, each rate at most
    ``peak_flops``: what calibration measured (:func:`autopar.cost_models.compute.kernel_rate`
    interpolates it); empty: every kernel at ``peak_flops x flops_efficiency``."""
    idle_reuse: float = 0.0
    reserve_bytes: float = 0.0
    reserve_fraction: float = 0.0
    flat_ring: tuple[str, ...] = ()
    """Collective kinds the backend runs as one flat ring over every rank of a group that
    spans several link levels (NCCL: ``("all_gather", "reduce_scatter")``, the GPU
    presets' default): priced on the slowest level's link at its bandwidth times the
    ranks of the faster levels, instead of the ideal hierarchical composition
    (:func:`autopar.cost_models.collective_costs.collective_time`)."""
    straggler: float = 1.0
    """The slowest rank's compute time against the ranks' mean over a step-long window
    (>= 1): a synchronous step goes at the slowest rank's pace, and where ranks share
    cores the scheduler is not fair over tens of milliseconds (4 gloo ranks on 2 cores:
    1.04 for 50 ms of a training layer, 1.12 with one more busy process).  Every compute
    price is multiplied by it; 1.0 on the presets, calibration measures it
    (:func:`autopar.cost_models.measure_sync.straggler`)."""
    sync_seconds: float = 0.0
    """What a collective issued between compute costs beyond its price after a barrier:
    ranks drift apart while they compute, and a collective ends only after the last one
    arrives (:func:`autopar.cost_models.measure_sync.sync_penalty`; 3-6 ms per collective for
    4 gloo ranks sharing 2 cores, where a rank that computes 20 ms lands milliseconds
    after its peers; 0 on the presets)."""
    sync_window: float = 0.0
    """The compute before each collective when ``sync_seconds`` was measured (the
    calibration's chunk, about 20 ms on CPU); 0 where unknown (the presets, older
    JSON).  A wait after longer compute pays more
    (:func:`autopar.cost_models.collective_costs.drift_after`)."""
    split_backward: float = 1.0
    """A backward split into ``B`` and ``W`` (the zero-bubble schedule,
    :mod:`autopar.runtime.split_backward`) over the same backward run whole (>= 1):
    torch's split runs some kernels twice (a LayerNorm's backward in ``B`` and again for
    its weights in ``W``) and the deferred weight gradients re-read activations that left
    the cache.  The ``cpu-gloo`` preset's 1.15 is from the GPT's two-stage pipeline on 4
    gloo ranks of this project's 2-core host, which measured zero-bubble 3-6 ms a step
    over 1F1B (8-23 ms with ZeRO-1) where it was priced 5 ms under (1.15 prices it 9 ms
    over); 1.0 on the GPU
    presets (not measured).  Calibration keeps its base preset's value: probes of one
    layer came out 1.02-1.63 on the same host, too noisy to plan with."""
    collective_pairing: float = 0.0
    """The share of a small collective's time a second one in flight on the same group
    at once saves (0: the backend runs them one at a time, as NCCL does on a
    communicator's stream; calibration measures it,
    :func:`autopar.cost_models.measure_sync.collective_pairing`): what multi-copy
    overlap's twin collectives save of their latencies."""
    host_bandwidth: float | None = None
    """Bytes/s one device copies to or from host memory, each way (a GPU's share of its
    PCIe link): what offloaded state pays per step (:mod:`autopar.search.offload`).
    None: ``mem_bandwidth`` (a CPU rank's host memory is its device memory)."""
    host_memory: float | None = None
    """Host memory per device that offloaded parameters and optimizer state may fill
    (the node's RAM over its devices, less what the processes need); None: unknown,
    and offload is then taken only when forced (``offload=``), never chosen."""
    host_mem_bandwidth: float | None = None
    """Bytes/s of host memory bandwidth per device that an offloaded optimizer step
    streams (the sockets' bandwidth over the node's devices); None: the rate the device's
    own optimizer step streams (``optimizer_bandwidth``, else ``mem_bandwidth``)."""
    search_shape: bool = False
    """Only the device count is given (:meth:`preset` with ``devices=``): the planner
    searches the mesh shape (:mod:`autopar.search.mesh_shapes`) and ``shape`` is the
    count as one axis until then.  :meth:`with_shape` names a shape and clears it."""

    def __post_init__(self) -> None:
        """Normalise sequences to tuples and validate every field (ValueError on bad input)."""
        # Frozen dataclass: normalisation has to bypass __setattr__.
        object.__setattr__(self, "shape", self.parse_shape(self.shape))
        names = tuple(self.axis_names) if self.axis_names else _default_axis_names(self.ndim)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "links", tuple(self.links))
        if len(names) != self.ndim:
            raise ValueError(f"MeshSpec has {self.ndim} axes but axis_names={names!r}")
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"MeshSpec.axis_names must be distinct non-empty str, got {names!r}")
        if len(self.links) != self.ndim:
            raise ValueError(f"MeshSpec has {self.ndim} axes but {len(self.links)} links")
        for i, (link, size) in enumerate(zip(self.links, self.shape)):
            if not isinstance(link, LinkSpec):
                raise ValueError(f"MeshSpec.links[{i}] must be a LinkSpec, got {link!r}")
            try:
                link.levels(size)
            except ValueError as e:
                raise ValueError(f"MeshSpec.links[{i}] (axis {names[i]!r}): {e}") from None
        for attr, interval in RANGES.items():
            interval.check(attr, getattr(self, attr))
        rb, rf = self.reserve_bytes, self.reserve_fraction
        if self.usable_memory <= 0:
            raise ValueError(f"MeshSpec reserve ({rb:g} bytes + {rf:g} of the device) leaves no "
                             f"memory of mem_capacity={self.mem_capacity:g}")
        object.__setattr__(self, "flat_ring", tuple(self.flat_ring))
        bad_kinds = set(self.flat_ring) - {"all_gather", "reduce_scatter", "all_reduce"}
        if bad_kinds:
            raise ValueError(f"MeshSpec.flat_ring lists {sorted(bad_kinds)}; it may list "
                             "all_gather, reduce_scatter and all_reduce")
        curve = tuple((float(f), float(r)) for f, r in self.matmul_curve)
        object.__setattr__(self, "matmul_curve", curve)
        if any(not (0 < f < math.inf and 0 < r <= self.peak_flops) for f, r in curve) or \
                any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
            raise ValueError("MeshSpec.matmul_curve must be (flops, rate) pairs in increasing flops "
                             f"with 0 < rate <= peak_flops, got {curve!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"MeshSpec.name must be a str, got {self.name!r}")
        if self.gpus_per_node is not None:
            _check_int("MeshSpec", "gpus_per_node", self.gpus_per_node, 1)
            if self.intra is None:
                raise ValueError("MeshSpec.gpus_per_node needs MeshSpec.intra")
        for attr in ("intra", "inter"):
            v = getattr(self, attr)
            if v is not None and not isinstance(v, LinkSpec):
                raise ValueError(f"MeshSpec.{attr} must be a LinkSpec or None, got {v!r}")

    def peak_for(self, dtype: torch.dtype | None) -> float:
        """Peak FLOP/s of a kernel computing in ``dtype``: :attr:`fp32_peak_flops` for fp32
        and fp64 where it is set, :attr:`peak_flops` otherwise (and for ``None``)."""
        if self.fp32_peak_flops is not None and dtype in (torch.float32, torch.float64):
            return self.fp32_peak_flops
        return self.peak_flops

    @property
    def usable_memory(self) -> float:
        """Bytes per device a plan may fill: ``mem_capacity`` less the reserve; the
        default memory budget of every search."""
        return self.mem_capacity * (1.0 - self.reserve_fraction) - self.reserve_bytes

    @property
    def size(self) -> int:
        """Number of devices (product of the shape)."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.shape)

    def axis_index(self, axis: int | str) -> int:
        """Index of a mesh axis given by index (negative allowed) or by name."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"unknown mesh axis {axis!r}; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if (isinstance(axis, bool) or not isinstance(axis, numbers.Integral)
                or not -self.ndim <= axis < self.ndim):
            raise ValueError(f"mesh axis {axis!r} out of range for a {self.ndim}-D mesh")
        return int(axis) % self.ndim

    @staticmethod
    def parse_shape(s: str | int | Sequence[int]) -> tuple[int, ...]:
        """Parse ``"2x4"`` -> ``(2, 4)``, ``"8"`` -> ``(8,)``; also accepts an int or a sequence.

        Every entry must be a positive int; anything else is a ValueError.
        """
        if isinstance(s, str):
            parts = s.lower().replace("*", "x").replace(",", "x").split("x")
            try:
                dims = tuple(int(p.strip()) for p in parts)
            except ValueError:
                raise ValueError(f"cannot parse mesh shape {s!r}; expected e.g. '8' or '2x4'") from None
        elif isinstance(s, bool):
            raise ValueError(f"mesh shape must be positive ints, got {s!r}")
        elif isinstance(s, numbers.Integral):
            dims = (s,)
        else:
            try:
                dims = tuple(s)
            except TypeError:
                raise ValueError(f"mesh shape must be positive ints, got {s!r}") from None
        bad = ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {s!r}")
        if not dims or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in dims):
            raise bad
        # Store plain ints: numpy integers would not survive json.dumps.
        out = tuple(int(d) for d in dims)
        if any(d < 1 for d in out):
            raise bad
        return out

    @classmethod
    def preset(
        cls,
        name: str,
        shape: tuple[int, ...] | str | None = None,
        axis_names: Sequence[str] | None = None,
        devices: int | None = None,
    ) -> MeshSpec:
        """A mesh for a known cluster (see :data:`PRESET_NAMES`), optionally reshaped.

        Single-node presets default to shape ``(8,)`` and reject shapes larger than a node;
        multinode presets default to ``(4, 8)`` (nodes x GPUs per node).  ``devices``
        instead of ``shape``: that many devices, whose mesh shape the planner searches
        (:attr:`search_shape`).
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown mesh preset {name!r}; known presets: {', '.join(PRESET_NAMES)}")
        if devices is not None and (shape is not None or isinstance(devices, bool)
                                    or not isinstance(devices, int) or devices < 1):
            raise ValueError(f"devices={devices!r}: give a positive device count, and no shape "
                             "with it (the shape is what the planner then searches)")
        p = _PRESETS[name]
        dims = (devices,) if devices is not None else p.default_shape if shape is None \
            else cls.parse_shape(shape)
        where = f"preset {name!r}" + (f" ({p.hint})" if p.hint else "")
        return cls(
            shape=dims,
            axis_names=tuple(axis_names) if axis_names is not None else (),
            links=_derive_links(dims, p.gpus_per_node, p.intra, p.inter, where),
            peak_flops=p.peak_flops,
            mem_bandwidth=p.mem_bandwidth,
            mem_capacity=p.mem_capacity,
            kernel_floor=p.kernel_floor,
            name=name,
            gpus_per_node=p.gpus_per_node,
            intra=p.intra,
            inter=p.inter,
            overlap=p.overlap,
            fp32_peak_flops=p.fp32_peak_flops,
            reserve_bytes=p.reserve_bytes,
            reserve_fraction=p.reserve_fraction,
            flat_ring=p.flat_ring,
            split_backward=p.split_backward,
            host_bandwidth=p.host_bandwidth,
            host_memory=p.host_memory,
            host_mem_bandwidth=p.host_mem_bandwidth,
            search_shape=devices is not None,
        )

    def with_shape(
        self, shape: tuple[int, ...] | str, axis_names: Sequence[str] | None = None
    ) -> MeshSpec:
        """The same cluster with a new logical shape; links are re-derived.

        With a node description (``intra`` set, as on presets) links follow the preset rule.
        Without one, links are kept when the number of axes is unchanged, or broadcast when all
        axes share one link; otherwise ValueError. Axis names are kept when the number of axes
        is unchanged and ``axis_names`` is not given, else they default to ``a0, a1, ...``.
        """
        dims = self.parse_shape(shape)
        if self.intra is not None:
            links = _derive_links(dims, self.gpus_per_node, self.intra, self.inter, f"mesh {self.name!r}")
        elif len(dims) == self.ndim:
            links = self.links
        elif len(set(self.links)) == 1 and not self.links[0].hierarchical:
            links = (self.links[0],) * len(dims)
        else:
            raise ValueError(
                f"mesh {self.name!r} has no node description (intra/gpus_per_node) and per-axis "
                f"links {self.links}; cannot derive links for shape {dims}"
            )
        if axis_names is None:
            axis_names = self.axis_names if len(dims) == self.ndim else ()
        return replace(self, shape=dims, axis_names=tuple(axis_names), links=links, search_shape=False)

    @classmethod
    def for_device(cls, device_name: str, total_memory: float, world: int) -> MeshSpec:
        """The preset nearest a GPU (by its name, as ``torch.cuda.get_device_name`` gives
        it) for ``world`` ranks as a 1-D mesh, with the device's own memory: what planning
        uses on a GPU when no mesh is named.  A100 and V100 get their presets' figures;
        any other GPU (H100, H200, newer) gets the H100's.  More than a node's 8 ranks get
        the multinode preset of that family."""
        upper = device_name.upper()
        if "V100" in upper:
            base = "p3.16xlarge"
        elif "A100" in upper:
            base = "multinode-a100-ib" if world > 8 else "8xA100-nvlink"
        else:
            base = "multinode-h100-ib" if world > 8 else "8xH100-nvlink"
        spec = cls.preset(base, shape=(world,))
        # the summary names the figures the plan used: the preset's, this device's memory
        name = f"{base} figures, {device_name} with {total_memory / 2**30:.0f} GiB"
        return replace(spec, mem_capacity=float(total_memory), name=name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict of every field (:func:`dataclasses.fields`, so a new
        field is saved without a change here): lists for tuples, nested dicts for links.
        ``name`` comes first, where a reader of plan.json looks for it."""
        d = {f.name: _to_json(getattr(self, f.name)) for f in fields(self)}
        return {"name": d.pop("name"), **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeshSpec:
        """Inverse of :meth:`to_dict`, field by field from their types (tuples and links
        rebuilt); unknown keys are a ValueError, missing optional keys (files written
        before a field existed) take their defaults.  A ``"calibration"`` key (what
        :func:`autopar.calibrate` measured, when and how noisy) is a record for people
        and is not read."""
        types = _field_types()
        unknown = set(d) - set(types) - {"calibration"}
        if unknown:
            raise ValueError(f"unknown MeshSpec keys: {sorted(unknown)}")
        kw = {k: _from_json(types[k], v) for k, v in d.items() if k != "calibration"}
        try:
            return cls(**kw)
        except TypeError as e:  # a required key is missing
            raise ValueError(f"incomplete MeshSpec dict: {e}") from None

    def to_json(self, path: str | PathLike[str] | None = None) -> str:
        """Serialise to JSON text; also write it to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path_or_text: str | PathLike[str]) -> MeshSpec:
        """Load from JSON text (a string starting with ``{``) or from a file path."""
        if isinstance(path_or_text, str) and path_or_text.lstrip().startswith("{"):
            text = path_or_text
        else:
            text = Path(path_or_text).read_text()
        return cls.from_dict(json.loads(text))


def _to_json(value: Any) -> Any:
    """A field's value as JSON: links as dicts, tuples (nested too) as lists."""
    if isinstance(value, LinkSpec):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


@functools.cache
def _field_types() -> dict[str, Any]:
    """Each :class:`MeshSpec` field's type, resolved from its annotation."""
    hints = get_type_hints(MeshSpec)
    return {f.name: hints[f.name] for f in fields(MeshSpec)}


def _from_json(hint: Any, value: Any) -> Any:
    """``value`` read from JSON as a field typed ``hint``: the inverse of :func:`_to_json`
    (a link's dict as a :class:`LinkSpec`, lists as tuples of their items' types)."""
    if value is None:
        return None
    args = get_args(hint)
    if get_origin(hint) in (Union, UnionType):  # ``X | None``: the value is not None
        return _from_json(next(a for a in args if a is not type(None)), value)
    if hint is LinkSpec:
        return LinkSpec.from_dict(value)
    if get_origin(hint) is tuple:
        items = [args[0]] * len(value) if args[-1:] == (Ellipsis,) else args
        if len(items) != len(value):  # a malformed pair: kept whole for __post_init__ to reject
            return tuple(value)
        return tuple(_from_json(t, v) for t, v in zip(items, value))
    return value
