"""Random numbers under autopar: dropout draws the mask of the whole (global) tensor.

Every rank draws from torch's default generator of its device (or, after
``pm.manual_seed(seed)``, from the module's own generator), and every rank draws the mask
of the *global* tensor, then keeps its own slice.  So:

* ``torch.manual_seed(s)`` reproduces a run: the masks follow torch's generator state, as
  the original model's do (the ranks must seed alike, which the first calls check:
  :mod:`autopar.runtime.call_check`);

* batch shards get independent masks (different parts of one global mask);
* tensor-parallel peers holding the same elements get identical masks (Megatron's RNG
  tracker solves the same problem with per-region seeds);
* the masks are the ones a single process would draw from a generator seeded alike, so a
  parallel run with dropout equals the single-process run (tests/dist/test_dropout.py);
* recomputation (activation checkpointing) replays the generator's state, so the
  recomputed mask is the forward's.

The cost is drawing the global mask on every rank: one element of random numbers per
element of the global activation, not of the local shard.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import Shard

from autopar.plans.placement import parse_placements
from autopar.runtime.mesh import current
from autopar.runtime.shards import shard_tensor

_CURRENT: list[torch.Generator | None] = [None]


def default_generator(device: torch.device) -> torch.Generator:
    """torch's default generator for ``device`` (what ``torch.manual_seed`` seeds and an
    eager dropout draws from)."""
    if device.type == "cuda":
        torch.cuda.init()  # the default generators exist once CUDA is initialised
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def use(generator: torch.Generator | None) -> None:
    """Make ``generator`` the one the generated code's dropouts draw from."""
    _CURRENT[0] = generator


@torch.fx.wrap
def sharded_dropout(x: torch.Tensor, p: float, train: bool, global_shape: tuple[int, ...],
                    placements: str) -> torch.Tensor:
    """Dropout of this rank's part ``x`` of a tensor of ``global_shape`` laid out by
    ``placements``: the global mask is drawn, this rank's slice kept (module docstring)."""
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0


    keep = torch.empty(global_shape, dtype=x.dtype, device=x.device)
    keep.bernoulli_(1.0 - p, generator=_CURRENT[0])
    pl = parse_placements(placements)
    if any(isinstance(q, Shard) for q in pl):  # Partial and Replicate keep the whole mask
        m = current()
        keep = shard_tensor(keep, pl, m.shape, m.coord)
    return x * keep / (1.0 - p)


sharded_dropout._autopar_train_arg = 2  # passes/train_mode.py sets it on train()/eval()


def replay_contexts():
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputation starts from the
    generator state the forward started from."""
    g = _CURRENT[0]
    saved = g.get_state() if g is not None else None

    @contextlib.contextmanager
    def forward():
        yield

    @contextlib.contextmanager
    def recompute():
        if g is None:
            yield
            return
        now = g.get_state()
        g.set_state(saved)
        try:
            yield
        finally:
            g.set_state(now)

    return forward(), recompute()


__all__ = ["default_generator", "replay_contexts", "sharded_dropout", "use"]
