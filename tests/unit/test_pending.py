"""PendingSum (autopar/runtime/pending.py): the loss whose all-reduce is in flight.

A stand-in work object records whether anything waited; the real all-reduce, the
backward and the values on two ranks are tested in tests/dist/test_training_loop.py.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from autopar.runtime.pending import PendingSum, _Sum


class _Work:
    """What ``dist.all_reduce(..., async_op=True)`` returns, counting waits; the sum
    lands in the buffer only when waited for, so a read that skipped the wait would
    see the rank's own partial value."""

    def __init__(self, buf: torch.Tensor, total: float) -> None:
        self.buf, self.total, self.waits = buf, total, 0

    def wait(self) -> None:
        self.waits += 1
        self.buf.fill_(self.total)


def _pending(partial: float = 1.0, total: float = 2.5) -> tuple[PendingSum, _Work]:
    buf = torch.tensor(partial)
    work = _Work(buf, total)
    return PendingSum(_Sum(buf, work)), work


@pytest.mark.parametrize("op", ["detach", "ones_like", "zeros_like", "empty_like", "shape"])
def test_shape_only_uses_and_detach_do_not_wait(op):
    p, work = _pending()
    out = {"detach": lambda: p.detach(), "ones_like": lambda: torch.ones_like(p),
           "zeros_like": lambda: torch.zeros_like(p), "empty_like": lambda: torch.empty_like(p),
           "shape": lambda: (p.shape, p.dtype, p.numel())}[op]()
    assert work.waits == 0
    if op == "detach":
        assert isinstance(out, PendingSum) and out.item() == 2.5 and work.waits == 1
    elif op == "ones_like":
        assert type(out) is torch.Tensor and out.item() == 1.0


def _saved(p):
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    return torch.load(buf)


READS = {
    "item": lambda p: p.item(), "float": float, "repr": repr, "str": str,
    "format": lambda p: f"{p:.2f}", "numpy": lambda p: p.numpy(), "tolist": lambda p: p.tolist(),
    "np.array": np.array, "deepcopy": copy.deepcopy, "torch.save": _saved,
    "times2": lambda p: p * 2, "stack": lambda p: torch.stack([p, p]), "cpu.numpy": lambda p: p.cpu().numpy(),
}
EXPECT = {"repr": "tensor(2.5000)", "str": "tensor(2.5000)", "format": "2.50"}


@pytest.mark.parametrize("name", list(READS))
def test_every_read_waits_once_and_sees_the_sum(name):
    """Each way logging code reads a loss waits for the sum (before the wait the buffer
    holds this rank's partial 1.0) and answers as a plain tensor would; the numpy,
    tolist, format and deepcopy paths failed on a bare wrapper subclass."""
    p, work = _pending()
    out = READS[name](p)
    assert work.waits == 1
    if name in EXPECT:
        assert out == EXPECT[name]
    elif name in ("times2", "stack"):
        assert type(out) is torch.Tensor and float(out.reshape(-1)[0]) == 2.5 * (2 if name == "times2" else 1)
    else:
        assert float(np.asarray(out)) == 2.5 and not isinstance(out, PendingSum)
    READS[name](p)  # a second read does not wait again
    assert work.waits == 1
