"""A small CNN trained for a few seconds on scikit-learn's handwritten digits (real data that
ships offline), upscaled to 16 x 16: the model whose int8 accuracy means something here
(torchvision's models have random weights: only their agreement with float32 is claimed)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

SHAPE = (1, 16, 16)


def factory() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))


def digits() -> tuple[np.ndarray, np.ndarray]:
    """Every digit (N, 1, 16, 16) in [0, 1], shuffled once (seeded), and its label."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = np.kron(data.images, np.ones((2, 2))).astype(np.float32)[:, None] / 16.0
    order = np.random.default_rng(0).permutation(len(x))
    return x[order], data.target[order].astype(np.int64)


def train(x: np.ndarray, y: np.ndarray, epochs: int = 6) -> nn.Module:
    """``factory()`` fitted to (x, y) with Adam (seeded)."""
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    for epoch in range(epochs):
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch))
        for batch in order.split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs[batch]), ys[batch]).backward()
            opt.step()
    return model.eval()
