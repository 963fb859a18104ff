"""runtime/compiled_cache.py: a compiled output that is a view of a linear's output,
across a graph break (as autopar's graph has before its runtime calls), compiled in
two fresh processes that share one inductor cache directory, torch's cache settings
as they come.  Without ``cache_safe_views`` the second process replays the view with
the sizes torch 2.13 pickled from freed memory (``RuntimeError: shape
'[94204390768082, 4805057143642108909, 128]' is invalid for input of size 8192``).
The values compared are one process's compiled and eager results (rel 1e-5: inductor
may reorder a sum)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import torch
from torch._functorch._aot_autograd.functional_utils import ViewMetaSequence
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from autopar.runtime.compiled_cache import cache_safe_views

SCRIPT = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    from autopar.runtime.compiled_cache import cache_safe_views
    cache_safe_views()

    def f(x, w):
        h = torch.nn.functional.linear(x, w)  # 3-D: ends in aten._unsafe_view
        v = h.view(-1, h.shape[-1])           # an output that is a view of another
        torch._dynamo.graph_break()
        return v.sum() * 2 + h.mean()

    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, requires_grad=True)
    w = torch.randn(128, 32, requires_grad=True)  # a training graph: its views are replayed
    out = torch.compile(f)(x, w)
    out.backward()
    print(json.dumps({"out": out.item(), "eager": f(x, w).item(),
                      "hits": counters["aot_autograd"]["autograd_cache_hit"]}))
""")


def test_a_second_process_loads_the_view_it_stored(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile-worker pool to start
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    for r in runs:
        assert abs(r["out"] - r["eager"]) <= 1e-5 * abs(r["eager"])
    assert runs[1]["hits"] > 0  # the second process did load the first one's entries


def test_only_the_chains_torch_misreads_are_left_out():
    cache_safe_views()
    x = torch.randn(8, 6)
    with FunctionalTensorMode():
        fx = FunctionalTensor.to_functional(x)
        unsafe = torch.ops.aten._unsafe_view.default(fx, [2, 4, 6]).view(8, 6)
        plain = fx.view(2, 4, 6)
        kept, left = ViewMetaSequence(plain), ViewMetaSequence(unsafe)
    assert pickle.loads(pickle.dumps(left)) is None
    again = pickle.loads(pickle.dumps(kept))
    assert [type(v).__name__ for v in again.sequence] == ["view_ViewMeta"]
    assert again.sequence[0].as_tuple()[-1] == [2, 4, 6]
