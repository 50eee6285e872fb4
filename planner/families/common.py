"""What every model family's image preprocessing is made of: Pillow geometry to the planned
size, then numpy scaling (and a normalisation, where the family has one), as torchvision's
transforms compute them in float32. No torch op runs here, so decoding threads never start
OpenMP teams beside the model's (``service.registry``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Preprocess = Callable[[Any], Any]  # a PIL image -> a (C, H, W) float tensor or array


@dataclass(frozen=True)
class ImagePreprocess:
    """A Pillow image (in the model's mode) -> its ``(C, H, W)`` float32 sample."""

    geometry: Callable[[Any], Any]  # a Pillow image -> a Pillow image of the planned size
    mean: np.ndarray | None
    std: np.ndarray | None
    description: str

    def __call__(self, image: Any) -> np.ndarray:
        x = np.asarray(self.geometry(image), dtype=np.float32) / np.float32(255)
        if x.ndim == 2:
            x = x[:, :, None]
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def plain_preprocess(height: int, width: int) -> ImagePreprocess:
    """What a model no family knows gets: resized to the planned size, scaled to [0, 1]."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    def plain(image: Any) -> Any:
        return F.resize(image, [height, width], interpolation=InterpolationMode.BILINEAR)
    return ImagePreprocess(plain, None, None, f"resize to {height}x{width}, scale to [0, 1]")
