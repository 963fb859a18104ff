"""ZeRO's dim-0 cut (autopar/runtime/zero_layout.py) is where DTensor puts each rank's
rows: every rank of 1-, 2- and 3-axis meshes, ZeRO over any subset of the axes,
tensor parallelism (Shard(0), Shard(1), Replicate) on the others, even and uneven
sizes.  Checked against ``compute_local_shape_and_global_offset`` (what DTensor's
``full_tensor``, ``clip_grad_norm_`` and DCP read) under a fake process group, so no
ranks are needed; and the collectives' buffers round-trip."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.runtime.zero_layout import Cut, pack, padded_size, placements, unpack

SHAPES = [(8, 4), (5, 3), (7,), (1, 6), (12, 6), (3, 2)]


def _tp_choices(mshape: tuple[int, ...], zaxes: tuple[int, ...]):
    others = [a for a in range(len(mshape)) if a not in zaxes]
    for kinds in itertools.product([None, 0, 1], repeat=len(others)):
        tp = [Replicate()] * len(mshape)
        for a, k in zip(others, kinds):
            if k is not None:
                tp[a] = Shard(k)
        yield tuple(tp)


def _local(shape, tp, mshape):
    """The tensor-parallel piece's shape, or None where tensor parallelism is uneven
    (autopar's tensor-parallel shards divide)."""
    out = list(shape)
    for a, p in enumerate(tp):
        if isinstance(p, Shard):
            if p.dim >= len(out) or out[p.dim] % mshape[a]:
                return None
            out[p.dim] //= mshape[a]
    return out


@pytest.mark.parametrize("mshape", [(4,), (2, 2), (2, 2, 2)])
def test_cut_is_where_dtensor_puts_each_rank(mshape):
    world = math.prod(mshape)
    checked = 0
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", mshape)
            coord = mesh.get_coordinate()
            for k in range(1, len(mshape) + 1):
                for zaxes in itertools.combinations(range(len(mshape)), k):
                    sizes = [mshape[a] for a in zaxes]
                    r = 0
                    for a in zaxes:
                        r = r * mshape[a] + coord[a]
                    for tp in _tp_choices(mshape, zaxes):
                        for shape in SHAPES:
                            local = _local(shape, tp, mshape)
                            if local is None:
                                continue
                            cut = Cut.of(local, sizes)
                            assert cut.size == padded_size(local, sizes)
                            want, off = compute_local_shape_and_global_offset(
                                shape, mesh, placements(tp, zaxes, mshape))
                            _, tp_off = compute_local_shape_and_global_offset(shape, mesh, tp)
                            assert tuple(want) == tuple(cut.local_shape(r)), (zaxes, tp, shape, coord)
                            row = math.prod(local[1:])
                            if cut.counts[r]:  # DTensor puts an empty shard at the end
                                assert off[0] == tp_off[0] + cut.starts[r] // row, (zaxes, tp, shape)
                                assert tuple(off[1:]) == tuple(tp_off[1:])
                            checked += 1
        finally:
            dist.destroy_process_group()
    assert checked >= world * len(SHAPES)


@pytest.mark.parametrize("shape,sizes", [((5, 3), [4]), ((5, 3), [2, 2]), ((7,), [2, 2]),
                                         ((1, 6), [4]), ((8, 2), [2, 2])])
def test_pack_and_unpack_round_trip(shape, sizes):
    d = math.prod(sizes)
    cut = Cut.of(shape, sizes)
    x = torch.randn(shape)
    buf = pack([x, None], [cut, cut], d, x)
    # each rank's part: its own padded buffer of x, then zeros for the missing tensor
    rows = buf.view(d, -1)
    for r in range(d):
        assert torch.equal(rows[r, : cut.size], cut.chunk(x, r))
        assert not rows[r, cut.size:].any()
        mine = x.reshape(-1)[cut.starts[r]:cut.starts[r] + cut.counts[r]]
        assert torch.equal(cut.view(cut.chunk(x, r), r), mine.view(cut.local_shape(r)))
    y, z = unpack(buf, d, [cut, cut])
    assert torch.equal(x, y) and not z.any()
    # one axis, or sizes that nest like one chunking: rank r starts at r * size; 5 rows
    # over 2 x 2 go 2, 1, 1, 1 (DTensor's nested chunks), which the general path reads
    assert cut.prefix == ((shape, sizes) != ((5, 3), [2, 2]))
