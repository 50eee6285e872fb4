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
class ImageSpec:
    """The geometry and normalisation of a model's images as data (stored with a compiled
    model, so a worker without torchvision preprocesses alike): the shorter side resized to
    ``resize`` then centre-cropped to ``height`` x ``width`` (``resize`` None: resized to
    that size), with Pillow's ``interpolation``, then mean and std where given."""

    height: int
    width: int
    resize: int | None
    interpolation: str              # a Pillow filter name: bilinear, bicubic, nearest, ...
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    description: str

    def to_json(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "resize": self.resize,
                "interpolation": self.interpolation,
                "mean": list(self.mean) if self.mean else None,
                "std": list(self.std) if self.std else None, "description": self.description}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ImageSpec":
        return cls(int(raw["height"]), int(raw["width"]),
                   None if raw.get("resize") is None else int(raw["resize"]),
                   str(raw["interpolation"]),
                   tuple(map(float, raw["mean"])) if raw.get("mean") else None,
                   tuple(map(float, raw["std"])) if raw.get("std") else None,
                   str(raw.get("description", "")))

    def geometry(self, image: Any) -> Any:
        """A Pillow image of the planned size, as torchvision's ``resize`` (shorter side,
        antialiased) and ``center_crop`` make it from a Pillow image."""
        from PIL import Image

        resample = getattr(Image.Resampling, self.interpolation.upper())
        if self.resize is None:
            return image.resize((self.width, self.height), resample)
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.resize, int(self.resize * long / short)
        size = (new_short, new_long) if w <= h else (new_long, new_short)
        if size != (w, h):
            image = image.resize(size, resample)
        w, h = image.size
        if w < self.width or h < self.height:  # torchvision pads; a resize above never leaves less
            image = image.resize((max(w, self.width), max(h, self.height)), resample)
            w, h = image.size
        top, left = int(round((h - self.height) / 2.0)), int(round((w - self.width) / 2.0))
        return image.crop((left, top, left + self.width, top + self.height))

    def preprocess(self) -> "ImagePreprocess":
        mean = np.asarray(self.mean, dtype=np.float32) if self.mean else None
        std = np.asarray(self.std, dtype=np.float32) if self.std else None
        return ImagePreprocess(self.geometry, mean, std, self.description, self)


@dataclass(frozen=True)
class ImagePreprocess:
    """A Pillow image (in the model's mode) -> its ``(C, H, W)`` float32 sample."""

    geometry: Callable[[Any], Any]  # a Pillow image -> a Pillow image of the planned size
    mean: np.ndarray | None
    std: np.ndarray | None
    description: str
    spec: ImageSpec | None = None   # the same as data, where it is (``ImageSpec``)

    def __call__(self, image: Any) -> np.ndarray:
        x = np.asarray(self.geometry(image), dtype=np.float32) / np.float32(255)
        if x.ndim == 2:
            x = x[:, :, None]
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def plain_preprocess(height: int, width: int) -> ImagePreprocess:
    """What a model no family knows gets: resized to the planned size, scaled to [0, 1]."""
    return ImageSpec(height, width, None, "bilinear", None, None,
                     f"resize to {height}x{width}, scale to [0, 1]").preprocess()
