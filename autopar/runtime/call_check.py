"""On the first call, check that the ranks agree on what the plan assumes they share.

Two habits of a training loop silently break a plan's assumptions, and neither shows in
any one rank's numbers:

* **Each rank passes its own batch under ``batch="global"``** (the ``DistributedSampler``
  habit of every DDP user).  The plan takes every rank's call as the *same* global batch
  and keeps each rank's slice of it, so rank r trains on rows it never loaded and the
  loss is nobody's batch.  Under ``batch="local"`` the same holds for the ranks that share
  a data-parallel index (tensor-parallel peers, pipeline stages).
* **The ranks' random generators differ** (seeded per rank, or not at all on one).  Each
  dropout draws the mask of the global tensor from the generator and keeps this rank's
  slice (:mod:`autopar.runtime.rng`): with different generators tensor-parallel peers drop
  different elements of one activation.

:class:`CallCheck` fingerprints the batch as each rank passed it (its bytes, summed, and
per row, weighted by the row's index: exact integer sums, equal on every rank for equal
data whatever the summation order) and the dropout generator's state, and all-gathers
them over the world: one collective of a few integers on the first
:data:`CHECKED_CALLS` call(s) after the module is made, after each ``train()``/``eval()``
switch and after the dropout generator is seeded anew.  One call catches the habits
above, which show from the first batch on; later steps issue only what the plan lists
(``plan.collectives()``).  Every rank sees every fingerprint, so on a disagreement every rank raises the
same :class:`CallMismatchError`, before any collective of the step could hang.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.errors import CallMismatchError
from autopar.plans.data import Plan
from autopar.runtime.inputs import BatchMode, data_parallel_axes

CHECKED_CALLS = 1
"""Calls checked after construction, a train()/eval() switch or a new seed."""

_MASK48 = (1 << 48) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK48


def tensor_fingerprint(x: torch.Tensor) -> list[int]:
    """Two integers for ``x``: the sum of its bytes and the sum over rows (dim 0) of
    each row's byte sum times (row index + 1), both exact (64-bit integer sums wrap
    alike on every rank), so equal tensors give equal fingerprints whatever the
    summation order, and different or reordered rows almost surely do not; shape and
    dtype are folded into the first."""
    meta = _digest(repr((tuple(x.shape), str(x.dtype))).encode())
    if x.numel() == 0:
        return [meta, 0]
    b = x.detach().contiguous().reshape(x.shape[0] if x.dim() else 1, -1)
    b = b.view(torch.uint8) if b.dtype != torch.bool else b.to(torch.uint8)
    rows = b.sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, device=rows.device, dtype=torch.int64)
    return [int(rows.sum()) ^ meta, int((rows * weights).sum())]


def leaf_fingerprint(x: object) -> list[int]:
    """:func:`tensor_fingerprint` of a tensor; of any other input, a digest of its repr
    (a Python number or flag passed with the batch must agree too)."""
    if isinstance(x, torch.Tensor):
        return tensor_fingerprint(x)
    return [_digest(repr(x).encode()), 0]


def gather_rows(row: list[int], device: torch.device) -> torch.Tensor:
    """Every rank's ``row`` (integers, the same length on every rank), as a
    ``world x len(row)`` int64 tensor on the CPU: one all-gather."""
    local = torch.tensor(row, dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size() * local.numel(), dtype=torch.int64, device=device)
    # torch 2.13 renamed all_gather_into_tensor (deprecated there: a FutureWarning
    # on every rank at the first call) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, local)
    return every.cpu().view(dist.get_world_size(), -1)


def generator_fingerprint(g: torch.Generator | None) -> int:
    """48 bits of a hash of ``g``'s state (agreed across ranks when the states are
    equal); 0 without a generator."""
    return 0 if g is None else _digest(g.get_state().numpy().tobytes())


class Agree(enum.Enum):
    """Which ranks compare their call's shapes before it runs (:func:`agreement`)."""

    NONE = "none"  # each rank runs its own shape: only gradients and the loss's sums meet
    SAME_DP = "same-dp"  # ranks of one data-parallel index (their activations meet)
    ALL = "all"  # every rank (activations cross data-parallel ranks, or a schedule runs)


def agreement(plan: Plan, moving: set[int]) -> Agree:
    """Which ranks of ``plan``'s mesh must call with equal shapes, so that none meets
    another in a collective of another size (gloo aborts the process; NCCL waits):
    ``moving``, the mesh axes over which activations (values computed from the inputs,
    not a scalar sum) cross ranks (-1: every axis).  A pipeline, micro-batches or copies
    run a schedule built for one shape: every rank agrees.  Under ``batch="global"``
    every rank holds the same batch, so any exchange of activations asks every rank to
    agree; under ``batch="local"`` ranks of different data-parallel indices hold their
    own rows and agree only where activations cross those indices.  A plan that
    exchanges only gradients and the loss's sums (data parallel, ZeRO), or runs on one
    rank, needs no agreement, as DDP.  The module's shape routes
    (:mod:`autopar.module.shapes`) and ``plan.collectives()`` both read this."""
    d = plan.decisions
    if math.prod(plan.mesh.shape) * max(1, d.pipeline_stages) == 1:
        return Agree.NONE  # one rank: nobody to disagree with
    if d.pipeline_stages > 1 or d.micro_batches > 1 or d.copies > 1 or -1 in moving:
        return Agree.ALL
    dp = set(data_parallel_axes(plan))
    if d.batch == BatchMode.LOCAL.value and dp:
        if moving & dp:
            return Agree.ALL
        return Agree.SAME_DP if moving else Agree.NONE
    return Agree.ALL if moving else Agree.NONE


def agreement_row(dims: Sequence[int]) -> int:
    """Integers each rank contributes to the shape exchange: whether it fails, its key
    and every dim of its flat inputs (``dims``: each input's number of dims, -1 for a
    non-tensor)."""
    return 2 + sum(max(0, k) for k in dims)


@dataclass
class CallCheck:
    """The agreement check of :mod:`autopar.runtime.call_check` for one module.

    ``key``: ranks with the same key must pass the same batch (0 on every rank under
    ``batch="global"``; the data-parallel rank under ``batch="local"``).  ``names``: the
    planned flat inputs' names (their number fixes the collective's size)."""

    key: int
    local: bool
    names: Sequence[str]
    device: torch.device
    left: int = CHECKED_CALLS
    mode: bool | None = None
    seed: int | None = None

    def due(self, training: bool, generator: torch.Generator | None = None) -> bool:
        """Whether this call is checked: the first call after construction, a
        ``train()``/``eval()`` switch or a new seed of the dropout generator
        (``torch.manual_seed(s)`` with another ``s``: the ranks may have seeded apart).
        Every rank answers alike when they agree, which is what is checked."""
        seed = generator.initial_seed() if generator is not None else None
        if self.mode is not training or self.seed != seed:
            self.mode, self.seed, self.left = training, seed, CHECKED_CALLS
        return self.left > 0 and dist.is_initialized() and dist.get_world_size() > 1

    def __call__(self, flat: Sequence[object] | None, generator: torch.Generator | None,
                 dropout: bool, failure: BaseException | None = None) -> None:
        """Check this call, collectively, when :meth:`due`: ``flat`` as this rank passed
        it (``None`` with the ``failure`` this rank's call raised, which every other rank
        then raises too, named)."""
        self.left -= 1
        n = len(self.names)
        mine = [self.key, generator_fingerprint(generator) if dropout else 0, int(failure is not None)]
        leaves = list(flat or [])[:n]
        for x in leaves:
            mine += leaf_fingerprint(x)
        mine += [0] * (3 + 2 * n - len(mine))
        every = gather_rows(mine, self.device)
        if bool(every[:, 2].any()):
            self._failed(every, failure)
        self._judge(every)

    def _failed(self, every: torch.Tensor, failure: BaseException | None) -> None:
        """Some rank's call raised: every rank raises, the failing ones their own error."""
        messages: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if failure is None else
                               (type(failure).__name__, str(failure)))
        if failure is not None:
            raise failure
        r = next(i for i in range(every.shape[0]) if int(every[i, 2]))
        kind, text = messages[r]
        raise CallMismatchError(f"rank {r}'s call failed ({kind}: {text}); every rank stops "
                                "here rather than wait for it")

    def _judge(self, every: torch.Tensor) -> None:
        """Raise for the first rank (in rank order) that disagrees with the lowest rank of
        its data-parallel index: the same error on every rank."""
        first: dict[int, int] = {}
        for r in range(every.shape[0]):
            lo = first.setdefault(int(every[r, 0]), r)
            if int(every[r, 1]) != int(every[lo, 1]):
                raise CallMismatchError(
                    f"rank {lo} and rank {r} draw dropout masks from random generators in "
                    "different states: autopar draws each mask for the whole tensor on every "
                    "rank and keeps each rank's part, so every rank must seed alike. Call "
                    "torch.manual_seed(seed) with the same seed on every rank (or pm.manual_seed"
                    "(seed)); draw per-rank randomness (data augmentation) from a "
                    "torch.Generator of your own")
            diff = [k // 2 for k in range(every.shape[1] - 3) if int(every[r, 3 + k]) != int(every[lo, 3 + k])]
            if diff:
                self._batch_error(lo, r, diff[0])

    def _batch_error(self, lo: int, hi: int, i: int) -> None:
        name = self.names[i] if i < len(self.names) else f"input {i}"
        if self.local:
            raise CallMismatchError(
                f"rank {lo} and rank {hi} hold the same part of the batch under batch='local' "
                f"(the same data_parallel_rank) but passed different {name}: ranks that share "
                "pm.data_parallel_rank (tensor-parallel peers, pipeline stages) must pass the "
                "same rows. Build the sampler with DistributedSampler(ds, num_replicas="
                "pm.data_parallel_size, rank=pm.data_parallel_rank)")
        raise CallMismatchError(
            f"rank {lo} and rank {hi} passed different {name}, but the plan was made with "
            "batch='global': every rank must pass the same, whole global batch, and each keeps "
            "its own part of it. If each rank loads its own part (DistributedSampler), plan "
            "with auto_parallel(..., batch='local') and sample with DistributedSampler(ds, "
            "num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank); the example "
            "inputs stay the global batch")


__all__ = ["CHECKED_CALLS", "Agree", "CallCheck", "agreement", "agreement_row", "generator_fingerprint", "leaf_fingerprint",
           "tensor_fingerprint"]
