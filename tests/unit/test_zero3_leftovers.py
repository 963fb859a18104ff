"""A backward that stops early (``autograd.grad`` with ``inputs=``, an error) can leave a
ZeRO-3 re-gather launched ahead, or re-gathered parameters, behind
(autopar.runtime.zero3): the next forward must not read them, since the optimizer may
have stepped since.  ``free_gathered_params`` drops them when a forward begins."""

from __future__ import annotations

import torch

from autopar.runtime import zero3


class _Done:
    """A collective's handle that has finished."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_forward_starts_without_a_stale_gather():
    work = _Done()
    zero3._AHEAD["zero3.test.0"] = (work, torch.zeros(4))
    zero3._BACKWARD["zero3.test.1"] = [torch.zeros(4)]
    try:
        with zero3.free_gathered_params():
            # what _gather would have used instead of gathering the current shards
            assert "zero3.test.0" not in zero3._AHEAD
            assert "zero3.test.1" not in zero3._BACKWARD
        assert work.waited  # completed before being dropped: no collective left in flight
    finally:
        zero3._AHEAD.pop("zero3.test.0", None)
        zero3._BACKWARD.pop("zero3.test.1", None)
