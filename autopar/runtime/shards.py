"""Move whole tensors to and from their local shards (for parameters and checkpoints)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from autopar.plans.placement import Placements


def shard_tensor(full: torch.Tensor, placements: Placements, mesh_shape: Sequence[int],
                 coord: Sequence[int]) -> torch.Tensor:
    """This coordinate's chunk of ``full`` (outer mesh axes shard first)."""
    x = full
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            size = x.shape[p.dim] // mesh_shape[a]
            x = x.narrow(p.dim, coord[a] * size, size)
    return x.contiguous()


def gather_tensor(local: torch.Tensor, placements: Placements, group_of) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over a live mesh (collective: every rank calls it).

    Inner axes are gathered first so nested shards of one dim reassemble in order.
    """
    x = local.detach()
    for a in reversed(range(len(placements))):
        p = placements[a]
        if isinstance(p, Shard):
            g = group_of(a)
            n = dist.get_world_size(g)
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x.contiguous(), group=g)
            x = torch.cat(parts, dim=p.dim)
    return x
