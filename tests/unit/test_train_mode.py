"""``pm.train()`` / ``pm.eval()`` set the mode argument of the captured graph's ops
(passes/train_mode.py) and must compute what the original module computes in that mode."""

from __future__ import annotations

import pytest
import torch
from autopar.passes.train_mode import set_train_mode
from torch import nn

from autopar.capture.trace import capture


@pytest.mark.parametrize("norm", [nn.InstanceNorm2d(4, affine=True),
                                  nn.BatchNorm2d(4, track_running_stats=False),
                                  nn.BatchNorm2d(4)], ids=["instance", "batch-no-stats", "batch"])
def test_eval_mode_matches_the_module(norm: nn.Module) -> None:
    """Norms without running statistics use the batch's in eval too (nn passes
    ``training=True`` for them): flipping their flag would make aten raise
    "running_mean must be defined in evaluation mode"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), norm)
    x = torch.randn(2, 3, 6, 6)
    gm = capture(model, (x,)).gm
    model.eval()
    set_train_mode([gm], False)
    with torch.no_grad():
        out = gm(x)  # the flat calling convention: a list of outputs
        torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, model(x))
