"""What to load: a model's name, input shape, dtype, device and weights file (no torch).

Its home is here, not beside the loaded module (``core.loaded``), so that a worker serving a
compiled model (``core.compiled``) names its models without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """What to load: the model's name and how to run it."""

    name: str
    input_shape: tuple[int, ...] | None = None  # per sample; None = the model's default
    dtype: str = "float32"
    device: str = "cpu"
    weights: Path | None = None
