"""Small models that tests load through ``package.module:factory``."""

from __future__ import annotations

import torch
from torch import nn


class MixesSamples(nn.Module):
    """Subtracts the batch mean: the samples of a batch depend on each other."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y - y.mean(0, keepdim=True)


class FixedBatch(nn.Module):
    """Reshapes with a batch size baked in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(3, -1))


class DataDependent(nn.Module):
    """Control flow on tensor values: torch.fx cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class TwoLayer(nn.Module):
    """A plain chain of two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class InplaceResidual(nn.Module):
    """A residual block whose ReLU after the add runs in place (that unit's output is its
    input: a view of the join's buffer), then a wide and a narrow 1x1 convolution, so that the
    most memory is held while the wide one runs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 1)
        self.inner = nn.Conv2d(64, 64, 1)
        self.relu = nn.ReLU(inplace=True)
        self.wide = nn.Conv2d(64, 512, 1)
        self.narrow = nn.Conv2d(512, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.narrow(self.wide(self.relu(self.inner(y) + y)))


class Unexportable(nn.Module):
    """A residual block whose branch ends in ``sinc``, which torch.onnx cannot export, and a
    concatenation of two branches after it: that one unit runs on torch, the rest anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.odd = nn.Conv2d(8, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 4, 1)
        self.right = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = x + torch.sinc(self.odd(x))
        return self.head(torch.cat([self.left(x), torch.relu(self.right(x))], 1))


def unexportable() -> nn.Module:
    return Unexportable()


def inplace_residual() -> nn.Module:
    return InplaceResidual()


def mixes_samples() -> nn.Module:
    return MixesSamples()


def fixed_batch() -> nn.Module:
    return FixedBatch()


def data_dependent() -> nn.Module:
    return DataDependent()


def two_layer() -> nn.Module:
    return TwoLayer()


def conv_chain() -> nn.Module:
    """Five 3x3 convolutions of 256 channels, 9 MB of weights, cheap on 8x8 inputs: sessions
    big enough for what making them takes per byte of weights to be measured."""
    return nn.Sequential(nn.Conv2d(3, 256, 3, padding=1), nn.ReLU(),
                         *(m for _ in range(4) for m in (nn.Conv2d(256, 256, 3, padding=1),
                                                         nn.ReLU())))


class OverflowsInHalf(nn.Module):
    """A linear layer whose outputs pass float16's largest number (65504) on the samples the
    capture inspects, and an op after it that makes NaN of the infinities (inf - inf), as a
    random-weight resnet101 does in float16: finite in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x.abs() + 1)
        return y - y


def overflows_in_half() -> nn.Module:
    return OverflowsInHalf()


class FlattensByView(nn.Module):
    """A convolution whose output is flattened with ``view``, which needs it NCHW-contiguous:
    the model cannot run channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.fc(y.view(y.shape[0], -1))


def flattens_by_view() -> nn.Module:
    return FlattensByView()


def raises() -> nn.Module:
    raise RuntimeError("no checkpoint here")


# How many samples the device of ``OutOfMemoryAbove`` holds; a test lowers it after planning,
# as when another process takes memory between the probe and the run.
DEVICE_CAPACITY = {"samples": 1 << 30}


@torch.fx.wrap
def device_capacity(x: torch.Tensor) -> torch.Tensor:
    """Stands for a device that runs out of memory above DEVICE_CAPACITY samples at once."""
    most = DEVICE_CAPACITY["samples"]
    if x.shape[0] > most:
        raise torch.OutOfMemoryError(f"tried {x.shape[0]} samples, the device holds {most}")
    return x


class OutOfMemoryAbove(nn.Module):
    """Two convolutions; the second raises torch's out-of-memory error above the capacity."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return device_capacity(self.b(torch.relu(self.a(x))))


def out_of_memory_above() -> nn.Module:
    return OutOfMemoryAbove()


# A file that, while it exists, holds every batch of ``gated_two_layer`` in its forward: a test
# in another process (a real `vbs serve`) creates it to keep requests in flight, removes it to
# let them through; ``<file>.held`` appears once a batch is held. Named by the environment
# variable below (unset: never held).
GATE_FILE_ENV = "VBS_TEST_GATE_FILE"


@torch.fx.wrap
def gate(x: torch.Tensor) -> torch.Tensor:
    import os

    path = os.environ.get(GATE_FILE_ENV)
    if path and os.path.exists(path):
        _held_at(path)  # a batch
    return x


def _held_at(path: str) -> None:
    """Say so (``<path>.held``) and wait while ``path`` exists: a condition across processes."""
    import os
    import time

    open(path + ".held", "w").close()
    while os.path.exists(path):
        time.sleep(0.005)


class GatedTwoLayer(TwoLayer):
    """``TwoLayer`` whose output waits while the gate file exists."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate(super().forward(x))


def gated_two_layer() -> nn.Module:
    return GatedTwoLayer()


# A file that, while it exists, holds ``planner_gated_two_layer`` in a `vbs plan` run as
# ``python -m service.commands`` (the planner a service starts beside serving an interim
# table, ``service.first_start``) the first time the model runs there: a test lets the planner
# publish only once it has seen the interim table serve. The process that serves never waits.
# ``<file>.held`` appears once the planner is held. Named by the environment variable below.
PLANNER_GATE_ENV = "VBS_TEST_PLANNER_GATE"


@torch.fx.wrap
def planner_gate(x: torch.Tensor) -> torch.Tensor:
    import os
    import sys

    path = os.environ.get(PLANNER_GATE_ENV)
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if path and main is not None and main.name == "service.commands" and os.path.exists(path):
        _held_at(path)  # the planner
    return x


class PlannerGatedTwoLayer(TwoLayer):
    """``TwoLayer`` whose output waits in the planner while the planner's gate file exists."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planner_gate(super().forward(x))


def planner_gated_two_layer() -> nn.Module:
    return PlannerGatedTwoLayer()


class ChannelsLastNorm(nn.Module):
    """ConvNeXt's LayerNorm2d: a LayerNorm over channels, computed channels-last and given
    back as a permuted view (its output is not dense in the model)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def channels_last_norm() -> nn.Module:
    """A stem whose normalised output is channels-last in the model, as ConvNeXt's: units ONNX
    Runtime computes right but takes only where nothing runs on torch."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), ChannelsLastNorm(16),
                         nn.Conv2d(16, 16, 1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
