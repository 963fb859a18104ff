"""A scalar output (the loss) whose all-reduce is still in flight.

Data parallelism leaves the loss a Partial sum; the value every rank reports is its
all-reduce.  Waiting for that all-reduce inside the forward puts a latency-bound
collective on the hot path that DDP does not have (DDP returns each rank's own loss).
Nothing in the step needs the value: the backward of a sum is the identity, computed
locally.  So the forward *starts* the all-reduce and returns a :class:`PendingSum`, a
tensor that waits for it the first time its value is used (``loss.item()``,
``float(loss)``, ``print(loss)``, ``f"{loss:.3f}"``, ``loss.numpy()``, ``loss + x``),
and never otherwise.
``loss.backward()`` and ``loss.detach()`` do not wait: the first only needs the shape
to seed the gradient, the second returns another pending view of the same sum, so a
training loop that logs every N steps pays the wait only when it logs.  Every rank
still issues the all-reduce in the same place of the forward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.utils._pytree import tree_map

from autopar.runtime.mesh import current
from autopar.runtime.tls import issue

aten = torch.ops.aten

# ops that read only the shape and dtype: a pending value can answer them now
_SHAPE_ONLY = frozenset({aten.ones_like.default, aten.zeros_like.default,
                         aten.empty_like.default, aten.full_like.default})


class _Sum:
    """The buffer being all-reduced and its work handle (shared by detached views)."""

    def __init__(self, buf: torch.Tensor, work) -> None:
        self.buf = buf
        self.work = work

    def value(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buf


class PendingSum(torch.Tensor):
    """A tensor whose value is an all-reduce still running: every op on it waits for
    the sum first and returns an ordinary tensor; shape-only ops and ``detach`` do not
    wait (see the module docstring)."""

    _sum: _Sum

    @staticmethod
    def __new__(cls, s: _Sum) -> PendingSum:  # noqa: D102
        r = torch.Tensor._make_wrapper_subclass(cls, s.buf.shape, dtype=s.buf.dtype,
                                                device=s.buf.device, requires_grad=False)
        r._sum = s
        return r

    # What reads the value outside torch's dispatcher (Python protocols, numpy): each
    # waits and answers as the plain tensor would, so logging code sees a tensor.
    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return repr(self._sum.value())

    def __format__(self, spec: str) -> str:  # noqa: D105
        return self._sum.value().__format__(spec)

    def __reduce_ex__(self, proto):  # noqa: D105
        # pickling (torch.save of a logged loss) stores the plain value
        return self._sum.value().clone().__reduce_ex__(proto)

    def __deepcopy__(self, memo) -> torch.Tensor:  # noqa: D105
        return self._sum.value().clone()

    def __array__(self, dtype=None, copy=None):  # noqa: D105
        a = self._sum.value().numpy()
        return a.astype(dtype) if dtype is not None else a

    def numpy(self, *, force: bool = False):  # noqa: D102
        return self._sum.value().numpy(force=force)

    def tolist(self):  # noqa: D102
        return self._sum.value().tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is aten.detach.default:
            return PendingSum(args[0]._sum)
        wait = func not in _SHAPE_ONLY

        def unwrap(x):
            if isinstance(x, PendingSum):
                return x._sum.value() if wait else x._sum.buf
            return x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


class _PendingSumFn(Function):
    @staticmethod
    def forward(ctx, x, axes):  # noqa: D102
        m = current()
        ctx.n = math.prod(m.shape[a] for a in axes)
        buf = x.detach().contiguous().clone()
        work = issue(dist.all_reduce, buf, group=m.group_of(axes), async_op=True)
        return PendingSum(_Sum(buf, work))

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        # every rank seeds the same gradient into the replicated sum, so the mirror
        # all-reduce would add n equal values: computed here without communicating
        if isinstance(g, PendingSum):
            g = g._sum.value()
        return g * ctx.n, None


# a compiled graph (ParallelModule.compile) stops here and runs it eagerly: dynamo cannot
# trace the creation of a tensor subclass, and said so in a warning on every rank
@torch.compiler.disable
def pending_sum(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """P -> R of a scalar output over ``axes``, left in flight: a :class:`PendingSum`
    (forward), ``g * n`` locally (backward, ``n`` the ranks summed over)."""
    return _PendingSumFn.apply(x, tuple(axes))
