"""A small model with a parallel block (two branches joined by concat), so the page has
branches to group under their block; fast to profile on two cores."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 8, 1)
        self.right_reduce = nn.Conv2d(8, 4, 3, padding=1)
        self.right = nn.Conv2d(4, 8, 1)
        self.head = nn.Conv2d(16, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        y = torch.cat([self.left(x), self.right(torch.relu(self.right_reduce(x)))], dim=1)
        y = torch.relu(self.head(y))
        return self.fc(y.mean(dim=(2, 3)))


def branchy() -> nn.Module:
    return Branchy().eval()
