"""Models whose weights outweigh their activations, for the tests of loading on demand
(``package.module:factory`` names): a small convolution, then a wide linear layer, so what a
loaded model keeps is its weights and the memory a test's limit allows is counted in them.
``heavy_40`` .. ``heavy_120`` keep about that many MB (the cgroup test serves five)."""

from __future__ import annotations

import torch
from torch import nn

INPUT = (3, 8, 8)  # the shape they are served at: name@3x8x8


class Heavy(nn.Module):
    """conv 3->4 (3x3, padded), flattened, then a linear layer to ``width`` outputs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * INPUT[1] * INPUT[2], width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def heavy() -> nn.Module:
    """About 4 MiB of weights (256 x 4096 floats)."""
    return Heavy(4096)


def heavier() -> nn.Module:
    """About 8 MiB of weights (256 x 8192 floats)."""
    return Heavy(8192)


def _of_mb(mb: int) -> nn.Module:
    """About ``mb`` MB of weights (each output takes 257 floats)."""
    return Heavy(mb * 10**6 // (4 * (4 * INPUT[1] * INPUT[2] + 1)))


def heavy_40() -> nn.Module:
    return _of_mb(40)


def heavy_60() -> nn.Module:
    return _of_mb(60)


def heavy_80() -> nn.Module:
    return _of_mb(80)


def heavy_100() -> nn.Module:
    return _of_mb(100)


def heavy_120() -> nn.Module:
    return _of_mb(120)
