"""A small multi-layer perceptron regression model (MSE loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """784-512-512-1 by default, the MindSpore D-Rec example's shape scaled by ``width``."""

    def __init__(self, d_in: int = 784, hidden: int = 512, d_out: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return F.mse_loss(self.fc3(h), y)


def build(d_in: int = 64, hidden: int = 128, d_out: int = 8,
          batch: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Factory for the CLI and tests: the model and one example batch."""
    torch.manual_seed(0)
    return MLP(d_in, hidden, d_out), (torch.randn(batch, d_in), torch.randn(batch, d_out))
