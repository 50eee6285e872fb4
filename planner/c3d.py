"""C3D (Tran et al., 2015), the video network of the VBS paper, written in this project.

8 Conv3d (3x3x3, stride 1, padding 1), 5 max-pools (the first keeps the time axis), 3 fully
connected layers; input clips of 3x16x112x112. Torchvision has no C3D, hence this module.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv3d(cin, cout, kernel_size=3, padding=1), nn.ReLU(inplace=True)]


class C3D(nn.Module):
    """The 8-conv, 5-pool, 3-fc C3D network."""

    input_shape = (3, 16, 112, 112)

    def __init__(self, num_classes: int = 487, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_conv(3, 64), nn.MaxPool3d(kernel_size=(1, 2, 2), stride=(1, 2, 2)),
            *_conv(64, 128), nn.MaxPool3d(kernel_size=2, stride=2),
            *_conv(128, 256), *_conv(256, 256), nn.MaxPool3d(kernel_size=2, stride=2),
            *_conv(256, 512), *_conv(512, 512), nn.MaxPool3d(kernel_size=2, stride=2),
            *_conv(512, 512), *_conv(512, 512),
            nn.MaxPool3d(kernel_size=2, stride=2, padding=(0, 1, 1)),
        )
        self.classifier = nn.Sequential(
            nn.Linear(8192, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.classifier(torch.flatten(x, 1))


def c3d(**kwargs: object) -> C3D:
    """The built-in ``c3d`` model."""
    return C3D(**kwargs)  # type: ignore[arg-type]
