"""Torchvision's classification and video models, by name: built with random weights, planned
for their weights' crop size (16x112x112 for video), their images preprocessed by their
weights' transforms, their outputs named by the weights' ImageNet categories.

Only the weights' metadata is read (no download). torchvision is imported when a model is
prepared, never when this module is: building the service app imports it.
"""

from __future__ import annotations

import warnings
from typing import Any


from core.errors import ModelError
from planner.families.common import ImagePreprocess, ImageSpec

VIDEO_SHAPE = (3, 16, 112, 112)


def _names() -> tuple[list[str], list[str]]:
    """(classification, video) model names that torchvision builds."""
    import torchvision

    classification = torchvision.models.list_models(module=torchvision.models)
    video = torchvision.models.list_models(module=torchvision.models.video)
    return classification, video


def names() -> list[str]:
    classification, video = _names()
    return [*classification, *video]


def knows(name: str) -> bool:
    return name in names()


def build(name: str) -> Any:
    import torchvision

    try:
        with warnings.catch_warnings():
            # GoogLeNet/Inception warn that their random init will change: not our concern.
            warnings.filterwarnings("ignore", message="The default weight initialization",
                                    category=FutureWarning)
            return torchvision.models.get_model(name, weights=None)
    except Exception as exc:
        raise ModelError(f"torchvision could not build {name!r}: {exc}") from exc


def input_shape(name: str) -> tuple[int, ...]:
    """The input a model was designed for: its weights' crop size, 16x112x112 for video."""
    import torchvision

    if name in _names()[1]:
        return VIDEO_SHAPE
    try:
        transforms = torchvision.models.get_model_weights(name).DEFAULT.transforms()
        crop = transforms.crop_size
        size = int(crop[0] if isinstance(crop, (list, tuple)) else crop)
        return (3, size, size)
    except Exception:  # noqa: BLE001 - no weights metadata: the ImageNet default
        return (3, 224, 224)


def preprocess(model_name: str, input_shape: tuple[int, int, int]) -> ImagePreprocess | None:
    """The weights' transforms (resize, centre crop, normalise:
    ``get_model_weights(name).DEFAULT.transforms()``) for an RGB input ``(3, H, W)``, with the
    crop set to the planned input size and the resize scaled alike (a planned 224 gives exactly
    the default transforms); a non-square input is resized to, then normalised. Held as data
    (``ImageSpec``: what torchvision's functional API does on a Pillow image, done by Pillow),
    so a compiled model carries it to a worker without torchvision. None for a model without
    such weights."""
    channels, height, width = input_shape
    weights = _weights(model_name) if channels == 3 else None
    if weights is None:
        return None
    default = weights.transforms()
    crop, resize = _first(default.crop_size), _first(default.resize_size)
    interpolation = str(default.interpolation.value)  # InterpolationMode: "bilinear", ...
    size = max(height, round(height * resize / crop)) if height == width else None
    # a non-square input: resized to it, then the weights' normalisation
    return ImageSpec(height, width, size, interpolation, tuple(map(float, default.mean)),
                     tuple(map(float, default.std)),
                     f"{model_name} weights' transforms, crop {height}x{width}").preprocess()


def _first(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _weights(model_name: str) -> Any:
    """The default weights enum of a torchvision classification model (meta only, no download)."""
    import torchvision

    if model_name not in torchvision.models.list_models(module=torchvision.models):
        return None
    try:
        weights = torchvision.models.get_model_weights(model_name).DEFAULT
        default = weights.transforms()
    except (ValueError, KeyError, AttributeError, TypeError):
        return None
    needed = ("crop_size", "resize_size", "mean", "std", "interpolation")
    return weights if all(hasattr(default, a) for a in needed) else None


def labels(model_name: str, classes: int) -> list[str] | None:
    """Class names from the torchvision weights' meta ("categories"), when they fit."""
    import torchvision

    try:
        if model_name not in torchvision.models.list_models():
            return None
        categories = torchvision.models.get_model_weights(model_name).DEFAULT.meta.get("categories")
    except (ValueError, KeyError, AttributeError):
        return None
    if isinstance(categories, list) and len(categories) == classes:
        return [str(c) for c in categories]
    return None
