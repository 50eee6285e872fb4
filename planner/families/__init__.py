"""Model families: how a model is built by name, what input it is planned for, how an image
becomes one of its samples, and what its output classes are called.

A family is one module here, with its entry in ``FAMILIES`` (the first that ``knows`` a name
builds it): ``names()`` (the names it builds, for a hint when a name is unknown),
``knows(name)``, ``build(name)`` (an ``nn.Module`` with random weights; ``planner.models``
loads a weights file into it), ``input_shape(name)``, ``preprocess(model_name, (C, H, W))`` (an
``ImagePreprocess``) and ``labels(model_name, classes)`` (class names), the last two None for
a model not its own. A model no family preprocesses gets its images resized to the planned
size and scaled to [0, 1], and no labels. Models whose input is not one image (C, H, W) with 1
or 3 channels take no images. Nothing here imports torch when imported: serving builds its
app without it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from types import ModuleType

from core.errors import ModelError
from planner.families import c3d, factory, torchvision
from planner.families.common import ImagePreprocess, Preprocess, plain_preprocess

FAMILIES = (c3d, factory, torchvision)


def family_of(name: str) -> ModuleType:
    """The family that builds model ``name``, or a ModelError naming the closest names."""
    for family in FAMILIES:
        if family.knows(name):
            return family
    known = [n for family in FAMILIES for n in family.names()]
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ModelError(f"unknown model {name!r}{hint}: use a torchvision classification or video "
                     "model name such as resnet50 or r3d_18, 'c3d', or 'package.module:factory'")


def build_preprocess(model_name: str, input_shape: Sequence[int]) -> tuple[Preprocess, str] | None:
    """The preprocessing of a model's images, and its Pillow mode; None when images do not fit."""
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        return None
    channels, height, width = (int(d) for d in input_shape)
    mode = "RGB" if channels == 3 else "L"
    for family in FAMILIES:
        found = family.preprocess(model_name, (channels, height, width))
        if found is not None:
            return found, mode
    return plain_preprocess(height, width), mode


def labels_for(model_name: str, classes: int) -> list[str] | None:
    """A model's class names, from its family, when they fit its ``classes`` outputs."""
    for family in FAMILIES:
        found = family.labels(model_name, classes)
        if found is not None:
            return found
    return None


__all__ = ["FAMILIES", "ImagePreprocess", "Preprocess", "build_preprocess", "family_of",
           "labels_for"]
