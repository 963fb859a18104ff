"""A small convolutional classifier (conv, batch-free norms, pooling, linear head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CNN(nn.Module):
    """Two conv layers with ReLU and average pooling, then a linear classifier."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool2d(F.relu(self.conv1(x)), 2)
        h = F.avg_pool2d(F.relu(self.conv2(h)), 2)
        logits = self.fc(torch.flatten(h, 1))
        return F.cross_entropy(logits, y)


def build(batch: int = 8, channels: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Factory for the CLI and tests: the model and one example batch (16x16 images)."""
    torch.manual_seed(0)
    return CNN(channels), (torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,)))
