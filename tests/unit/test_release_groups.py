"""autopar/runtime/mesh.py's release_groups: finding live DeviceMeshes says nothing.

It scans every object the garbage collector tracks.  With ``isinstance``, DeviceMesh's
metaclass read attributes of each, and reading ``torch.distributed.reduce_op`` (always
alive once torch.distributed is imported) printed ``FutureWarning: reduce_op is
deprecated`` on every rank when a module shut down: eight lines after the README's
training run on 4 ranks.
"""

from __future__ import annotations

import types
import warnings

import torch.distributed as dist

from autopar.runtime.mesh import release_groups


def test_release_groups_warns_nothing():
    assert dist.reduce_op is not None  # the deprecated object is alive
    mesh = types.SimpleNamespace(flat={"a": 1}, device_mesh=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        release_groups(mesh)
    assert mesh.flat == {}
    assert [str(w.message) for w in caught] == []
