"""The process-group side of a mesh: one ``DeviceMesh`` per process, looked up by the
collectives that generated code calls with a plain mesh-axis index."""

from __future__ import annotations

import datetime
import gc
import itertools
import math
import os
from dataclasses import dataclass, field

import torch

# Before any process group exists (this module loads with ``import autopar``): torch 2.13
# keeps 10 references to the world group for good when torch._dynamo is first imported
# after the group is made (capture imports it), so the group's gloo threads would
# outlive destroy_process_group() and can abort the process at exit (release_groups).
import torch._dynamo  # noqa: F401, I001
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import MeshMismatchError
from autopar.plans.splits import stage_ranks


@dataclass
class RuntimeMesh:
    """The running mesh: shape, this rank's coordinate, one group per mesh axis.

    With pipeline parallelism the device mesh has an extra leading *pipeline axis*
    (one entry per stage); ``shape``, ``coord`` and ``group(axis)`` then describe the
    stage's sub-mesh, the mesh the plan's placements refer to, so generated code is the
    same with or without pipelining.
    """

    shape: tuple[int, ...]
    device_mesh: DeviceMesh
    coord: tuple[int, ...]
    stages: int = 1
    stage: int = 0
    device: torch.device = torch.device("cpu")
    flat: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    pipeline_axis: int = 0
    """The axis of the requested mesh the stages were carved from (the rank layout)."""

    def group(self, axis: int) -> dist.ProcessGroup:
        """Process group of the ranks that differ only along (sub-mesh) ``axis``."""
        return self.device_mesh.get_group(axis + (1 if self.stages > 1 else 0))

    def group_of(self, axes: tuple[int, ...]) -> dist.ProcessGroup:
        """Process group of the ranks that differ only along the (sub-mesh) ``axes``:
        one collective over several axes (a gradient replicated on a 2-D data-parallel
        mesh is all-reduced once, asynchronously, not once per axis)."""
        if len(axes) == 1:
            return self.group(axes[0])
        return self.flat[tuple(sorted(axes))]

    def size_of(self, axes: tuple[int, ...]) -> int:
        """Ranks in :meth:`group_of` ``(axes)``."""
        return math.prod(self.shape[a] for a in axes)

    def coord_of(self, axes: tuple[int, ...]) -> int:
        """This rank's index in :meth:`group_of` ``(axes)``: row-major over the sorted
        axes, the order the group's ranks are listed in (:func:`_flat_groups`)."""
        i = 0
        for a in sorted(axes):
            i = i * self.shape[a] + self.coord[a]
        return i

    def stage_rank(self, stage: int) -> int:
        """Global rank of the rank with this rank's sub-mesh coordinate in ``stage``."""
        if self.stages == 1:
            return dist.get_rank()
        return int(self.device_mesh.mesh[(stage, *self.coord)].item())

    @property
    def param_mesh(self) -> DeviceMesh:
        """The ``DeviceMesh`` the plan's placements refer to: the whole mesh, or this
        rank's pipeline stage's sub-mesh (parameters are DTensors on it)."""
        if self.stages == 1:
            return self.device_mesh
        names = self.device_mesh.mesh_dim_names
        return self.device_mesh[names[1:]] if len(names) > 2 else self.device_mesh[names[1]]

    @property
    def size(self) -> int:
        """Number of ranks in the (sub-)mesh."""
        n = 1
        for s in self.shape:
            n *= s
        return n


_CURRENT: RuntimeMesh | None = None


def init_mesh(shape: tuple[int, ...], backend: str | None = None, stages: int = 1,
              timeout: float | None = None, pipeline_axis: int = 0,
              mesh_shape: tuple[int, ...] | None = None) -> RuntimeMesh:
    """Initialise (or reuse) the default process group and build the mesh.

    ``timeout`` (seconds, default 600) is the collective timeout of a process group
    created here.  ``shape`` is the mesh of the plan's placements; with ``stages > 1`` it is each
    pipeline stage's sub-mesh and the world is ``stages`` times its size.  The stages
    are carved from ``pipeline_axis`` of ``mesh_shape`` (the requested mesh, ranks
    row-major as torchrun numbers them): axis 0 makes each stage a block of consecutive
    ranks; a later axis (stages inside a node) interleaves them
    (:func:`autopar.plans.splits.stage_ranks`).

    Raises :class:`MeshMismatchError` when the world size differs from the mesh size:
    running a plan on the wrong number of ranks would silently compute garbage.
    """
    global _CURRENT
    size = stages
    for s in shape:
        size *= s
    full = (stages, *shape) if stages > 1 else tuple(shape)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise MeshMismatchError(
                f"the plan is for a mesh of {size} ranks {full} but no process group is "
                "initialised and RANK is not set; launch with torchrun "
                f"--nproc-per-node {size} (planning alone needs no process group)"
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            # one GPU per process: the one torchrun's LOCAL_RANK names
            torch.cuda.set_device(local_device(backend))
        # a bounded collective timeout (gloo's default is 30 minutes): a dead rank ends
        # the job within ``timeout`` seconds
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout or 600.0))
    world = dist.get_world_size()
    if world != size:
        raise MeshMismatchError(
            f"the plan's mesh {full} has {size} devices but the world size is {world}; "
            f"re-plan for {world} devices or launch {size} ranks"
        )
    axis = pipeline_axis if stages > 1 else 0
    if _CURRENT is not None and (_CURRENT.stages, _CURRENT.shape, _CURRENT.pipeline_axis) == \
            (stages, tuple(shape), axis):
        return _CURRENT
    dev = local_device(dist.get_backend())
    device = dev.type
    # named axes let a pipeline stage slice out its sub-mesh (``param_mesh``)
    names = (("pp",) if stages > 1 else ()) + tuple(f"a{i}" for i in range(len(shape)))
    if axis:
        dm = DeviceMesh(device, _stage_layout(full, axis, mesh_shape), mesh_dim_names=names)
    else:
        dm = init_device_mesh(device, full, mesh_dim_names=names)
    coord = tuple(int(c) for c in dm.get_coordinate())
    if stages > 1:
        _CURRENT = RuntimeMesh(tuple(shape), dm, coord[1:], stages, coord[0], dev, pipeline_axis=axis)
    else:
        _CURRENT = RuntimeMesh(tuple(shape), dm, coord, device=dev)
    _CURRENT.flat = _flat_groups(dm, stages > 1, timeout)
    return _CURRENT


def init_plan_mesh(plan, timeout: float | None = None) -> RuntimeMesh:
    """:func:`init_mesh` for ``plan`` (a :class:`~autopar.plans.Plan`): its stage
    sub-mesh, stage count, and the axis of the requested mesh the stages come from."""
    d = plan.decisions
    return init_mesh(tuple(plan.mesh.shape), stages=d.pipeline_stages, timeout=timeout,
                     pipeline_axis=d.pipeline_axis, mesh_shape=tuple(plan.request.mesh_shape) or None)


def _stage_layout(full: tuple[int, ...], axis: int, mesh_shape: tuple[int, ...] | None) -> torch.Tensor:
    """The global ranks of the device mesh ``full`` (pipeline axis first) for stages
    carved from ``axis`` of ``mesh_shape``."""
    if not mesh_shape or math.prod(mesh_shape) != math.prod(full):
        raise MeshMismatchError(
            f"the plan's {full[0]} pipeline stages are carved from mesh axis {axis}, which needs "
            f"the mesh they were carved from (the plan's request.mesh_shape), got {mesh_shape}")
    ranks = stage_ranks(tuple(mesh_shape), full[0], axis)
    if tuple(ranks.shape) != full:
        raise MeshMismatchError(
            f"{full[0]} stages carved from axis {axis} of the mesh {tuple(mesh_shape)} give stage "
            f"sub-meshes {tuple(ranks.shape[1:])}, but the plan's sub-mesh is {full[1:]}")
    return ranks


def _flat_groups(dm: DeviceMesh, pipelined: bool,
                 timeout: float | None) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One process group per set of two or more sub-mesh axes, for this rank.

    ``new_group`` is collective over the whole world: every rank creates every group,
    in the same order (axis sets in order, then the groups' rank lists in order), and
    keeps the one it belongs to.  Made here, once, because later only some ranks (one
    pipeline stage) would need a given group."""
    mesh = dm.mesh
    lead = 1 if pipelined else 0
    sub = mesh.ndim - lead
    me = dist.get_rank()
    out: dict[tuple[int, ...], dist.ProcessGroup] = {}
    kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
    for k in range(2, sub + 1):
        for axes in itertools.combinations(range(sub), k):
            dims = [a + lead for a in axes]
            rest = [d for d in range(mesh.ndim) if d not in dims]
            # ranks sharing the other coordinates: move the group's dims last, flatten
            ranks = mesh.permute(*rest, *dims).reshape(-1, math.prod(mesh.shape[d] for d in dims))
            for row in ranks.tolist():
                g = dist.new_group(row, **kw)
                if me in row:
                    out[axes] = g
    return out


def local_device(backend: str | None = None) -> torch.device:
    """The device this process computes on: ``cuda:LOCAL_RANK`` under NCCL (torchrun
    sets ``LOCAL_RANK``; one GPU per process), else the CPU (gloo)."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def current() -> RuntimeMesh:
    """The mesh set up by :func:`init_mesh`."""
    if _CURRENT is None:
        raise RuntimeError("autopar: no mesh initialised; create the ParallelModule first")
    return _CURRENT


def activate(m: RuntimeMesh) -> None:
    """Make ``m`` the mesh the runtime's collectives use (:func:`current`).

    Every :class:`~autopar.module.parallel.ParallelModule` activates its own mesh when
    it runs: a process may hold modules planned for different meshes (``autopar.verify``'s
    candidates, a model and its pipelined copy), and a module run with another's mesh
    would scatter its inputs and reduce its gradients over the wrong groups.  The
    backward that follows a forward uses the mesh that forward activated."""
    global _CURRENT
    _CURRENT = m


def reset() -> None:
    """Forget the current mesh (tests re-create it between process groups)."""
    global _CURRENT
    _CURRENT = None


def release_groups(m: RuntimeMesh) -> None:
    """Drop the references ``m`` and every live ``DeviceMesh`` hold to process groups,
    after ``destroy_process_group()``, so the groups are destroyed now and gloo joins
    its worker threads while the interpreter is whole.

    Why: the ``DeviceMesh`` (which the module's DTensor parameters keep alive) holds its
    groups in ``_pg_registry``.  While a group lives, its worker threads do too, and they
    may still drop the last reference to a finished work.  At interpreter exit that
    can need the GIL after finalization has begun, which aborts the process ("terminate
    called without an active exception"; autopar/runtime/tls.py has the rest).  torch
    destroys a group with the GIL released, so the workers can finish first."""
    m.flat.clear()
    # every live DeviceMesh, not only ``m``'s: torch's DTensor caches keep older meshes
    # alive, and a copied mesh (unpickling re-resolves its groups) holds its own
    # registry.  After destroy_process_group() every group they name is dead anyway.
    gc.collect()
    # by the type's MRO, not isinstance: DeviceMesh's metaclass hook reads attributes of
    # every object asked about, and reading torch.distributed's deprecated ``reduce_op``
    # printed a FutureWarning per rank after training
    live = [o for o in gc.get_objects() if DeviceMesh in type(o).__mro__]
    for dm in [m.device_mesh, *live]:
        registry = getattr(dm, "_pg_registry", None)  # on the root mesh (torch 2.13)
        if isinstance(registry, dict):
            registry.clear()
    gc.collect()
