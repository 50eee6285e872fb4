"""What a model is once loaded, as planner, workers and service pass it around: the spec
(what to load and how to run it) and the module in eval mode with its input shape.

Loading itself (torchvision, the built-in C3D, a factory, a weights file) is
``planner.models.load_model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core.spec import ModelSpec

__all__ = ["DTYPES", "LoadedModel", "ModelSpec"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode on its device and dtype, with the input shape it is planned for."""

    spec: ModelSpec
    module: nn.Module
    input_shape: tuple[int, ...]
    torch_dtype: torch.dtype
    # its 4-d weights, and so its activations, in channels_last (NHWC): bfloat16 on the CPU,
    # where oneDNN's bfloat16 kernels (AMX) take NHWC (``planner.models.channels_last``)
    channels_last: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.device)

    def example(self, batch: int, seed: int = 0) -> torch.Tensor:
        """A reproducible random input of ``batch`` samples."""
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *self.input_shape), generator=gen)
        return x.to(device=self.device, dtype=self.torch_dtype)
