"""Ring attention (autopar/runtime/ring_attention.py) equals SDPA on the global tensors.

Real gloo process groups on 2 and 4 ranks (one spawn per world size for all cases):
the output and the q, k, v gradients (backward with a random upstream gradient) of each
rank's sequence chunk equal the chunk of ``F.scaled_dot_product_attention`` on the whole
tensors, for non-causal, causal balanced (zigzag) and unbalanced rings, an odd local
length (falls back to the plain ring), grouped-query attention, boolean and additive
masks (one with fully masked rows), an explicit scale, and rings over a 2x2 mesh.  A
thread simulator (replacing ``ring_of``) runs a 3-rank ring, where the zigzag re-layout
sends two sub-chunks to one peer, and counts the bytes the cost factors predict.

Tolerance 1e-10, in fp64: the ring computes the same sums as SDPA in another order and
through the log-sum-exp merge, so the difference is a few ulps times the reduction
length (~1e-15 at these O(1) sizes); any wrong block, mask or gradient route is O(0.1).
"""

from __future__ import annotations

import math
import queue
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import ring_attention as ra
from tests.dist.harness import run_fn_cases

FN = "tests.dist.test_ring_attention:run_case"
TOL = 1e-10


def _case(id: str, mesh=(2,), axes=(0,), causal=True, balance=True, local=8, hk=4,
          mask: str | None = None, scale: float | None = None) -> dict:
    return {"id": id, "mesh": list(mesh), "axes": list(axes), "causal": causal,
            "balance": balance, "local": local, "hk": hk, "mask": mask, "scale": scale}


TWO = [_case("noncausal", causal=False), _case("causal-balanced"),
       _case("causal-unbalanced", balance=False), _case("odd-local", local=5),
       _case("gqa", hk=2), _case("pad-mask", causal=False, mask="pad"),
       _case("pad-mask-causal", mask="pad"), _case("additive-mask", causal=False, mask="float"),
       _case("empty-rows", causal=False, mask="empty"), _case("scale", scale=0.3)]
FOUR = [_case("causal-balanced-4", mesh=(4,)), _case("causal-unbalanced-4", mesh=(4,), balance=False),
        _case("gqa-mask-4", mesh=(4,), hk=2, mask="pad", local=6),
        _case("mesh2x2-axes01", mesh=(2, 2), axes=(0, 1)),
        _case("mesh2x2-axes10", mesh=(2, 2), axes=(1, 0), mask="pad"),
        _case("mesh2x2-axis1", mesh=(2, 2), axes=(1,))]


def _globals(c: dict, n: int) -> dict[str, torch.Tensor | None]:
    """The global q, k, v, mask and upstream gradient of case ``c`` (same on every rank)."""
    g = torch.Generator().manual_seed(0)
    b, hq, s, d = 2, 4, n * c["local"], 8
    t = {x: torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
         for x, h in (("q", hq), ("k", c["hk"]), ("v", c["hk"]), ("dout", hq))}
    mask = None
    if c["mask"] in ("pad", "empty"):
        # padding: batch 1's last 3 keys are padding; "empty" also masks query row 2 whole
        mask = torch.ones(b, 1, s, s, dtype=torch.bool)
        mask[1, :, :, s - 3:] = False
        if c["mask"] == "empty":
            mask[:, :, 2, :] = False
    elif c["mask"] == "float":
        mask = torch.randn(1, hq, s, s, generator=g, dtype=torch.float64)
    return t | {"mask": mask}


def run_case(c: dict) -> dict:
    """On every rank: ring attention on this rank's chunk against SDPA on the whole
    tensors; the worst error over all ranks."""
    from autopar.runtime.mesh import init_mesh

    m = init_mesh(tuple(c["mesh"]))
    axes = tuple(c["axes"])
    n, pos = math.prod(m.shape[a] for a in axes), 0
    for a in axes:
        pos = pos * m.shape[a] + m.coord[a]
    t = _globals(c, n)
    L = c["local"]
    loc = {x: t[x].narrow(2, pos * L, L).clone().requires_grad_(True) for x in "qkv"}
    out = ra.ring_attention(loc["q"], loc["k"], loc["v"], t["mask"], c["causal"], c["scale"],
                            axes, c["balance"])
    out.backward(t["dout"].narrow(2, pos * L, L))
    glob = {x: t[x].clone().requires_grad_(True) for x in "qkv"}
    ref = F.scaled_dot_product_attention(glob["q"], glob["k"], glob["v"], attn_mask=t["mask"],
                                         is_causal=c["causal"], scale=c["scale"],
                                         enable_gqa=c["hk"] != 4)
    ref.backward(t["dout"])
    errs = [(out - ref.narrow(2, pos * L, L)).abs().max()]
    errs += [(loc[x].grad - glob[x].grad.narrow(2, pos * L, L)).abs().max() for x in "qkv"]
    e = torch.stack(errs).nan_to_num(math.inf)
    dist.all_reduce(e, op=dist.ReduceOp.MAX)
    return {"out": e[0].item(), "dq": e[1].item(), "dk": e[2].item(), "dv": e[3].item(),
            "scale": ref.abs().max().item()}


@pytest.fixture(scope="module")
def two():
    return run_fn_cases(2, FN, TWO)


@pytest.fixture(scope="module")
def four():
    return run_fn_cases(4, FN, FOUR)


def _check(res: dict, case: str) -> None:
    r = res[case]
    assert "error" not in r, r.get("error")
    assert r["scale"] > 0.1  # the reference is not trivially zero
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= TOL, (case, key, r[key])


@pytest.mark.parametrize("case", [c["id"] for c in TWO])
def test_two_ranks(two, case):
    _check(two, case)


@pytest.mark.parametrize("case", [c["id"] for c in FOUR])
def test_four_ranks(four, case):
    _check(four, case)


# ---- cost factors: counted from the schedule the function runs, and by a simulator ----

@pytest.mark.parametrize("causal,balance", [(False, False), (True, False), (True, True)])
def test_compute_factor_counts_blocks(causal, balance):
    assert ra.ring_balanced(6) and not ra.ring_balanced(5)
    for n in range(1, 9):
        L = 6
        work = [sum(b.q_len * b.k_len for b in ra.ring_schedule(n, p, L, L, causal, balance and n > 1))
                for p in range(n)]
        assert max(work) / (n * L) ** 2 == pytest.approx(ra.ring_attention_cost_factors(n, causal, balance)[0])
        if causal and balance and n > 1:
            assert len(set(work)) == 1  # zigzag: every rank does the same work


class _Boxes:
    """Queues keyed by (source, destination, tag), created on first use under a lock: a
    ``defaultdict(queue.Queue)`` shared by threads can create one key's queue twice when
    two threads miss it at once (the factory is Python code, the GIL may switch inside
    it); the second replaces the first and a receiver then waits on a queue no one fills."""

    def __init__(self) -> None:
        self.lock, self.queues = threading.Lock(), {}

    def __getitem__(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            if key not in self.queues:
                self.queues[key] = queue.Queue()
            return self.queues[key]


class _SimRing:
    """A ring of threads in one process: messages go through queues keyed by
    (source, destination, tag); counts the bytes each rank sends."""

    def __init__(self, boxes: _Boxes, n: int, pos: int) -> None:
        self.boxes, self.size, self.pos, self.sent = boxes, n, pos, 0

    def exchange(self, sends, recvs) -> None:
        for t, p, tag in sends:
            self.boxes[(self.pos, p, tag)].put(t.clone())
            self.sent += t.nbytes
        for t, p, tag in recvs:
            t.copy_(self.boxes[(p, self.pos, tag)].get(timeout=30))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_simulated_ring_exact_and_transfer_factor(monkeypatch, n):
    c = _case("sim", mesh=(n,), local=4)
    t = _globals(c, n)
    lock = threading.Lock()
    boxes = _Boxes()
    rings = {}
    monkeypatch.setattr(ra, "ring_of", lambda axes: rings[threading.get_ident()])
    res: dict[int, tuple] = {}

    def rank(p: int) -> None:
        with lock:
            rings[threading.get_ident()] = ring = _SimRing(boxes, n, p)
        loc = [t[x].narrow(2, p * 4, 4).clone().requires_grad_(True) for x in "qkv"]
        out = ra.ring_attention(*loc, None, True, None, (0,), True)
        sent = ring.sent
        out.backward(t["dout"].narrow(2, p * 4, 4))
        res[p] = (out.detach(), [x.grad for x in loc], sent / (loc[1].nbytes + loc[2].nbytes))

    threads = [threading.Thread(target=rank, args=(p,)) for p in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    glob = [t[x].clone().requires_grad_(True) for x in "qkv"]
    ref = F.scaled_dot_product_attention(*glob, is_causal=True)
    ref.backward(t["dout"])
    for p in range(n):
        out, grads, _ = res[p]
        assert (out - ref.narrow(2, p * 4, 4)).abs().max() <= TOL
        for g, gg in zip(grads, glob):
            assert (g - gg.grad.narrow(2, p * 4, 4)).abs().max() <= TOL
    assert max(r[2] for r in res.values()) == ra.ring_attention_cost_factors(n, True, True)[1]
