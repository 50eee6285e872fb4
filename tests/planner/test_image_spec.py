"""Images preprocessed from data (``ImageSpec``, what a worker without torchvision uses) equal
torchvision's own ``resize`` and ``center_crop`` on the same Pillow image, pixel for pixel."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from planner.families import build_preprocess
from planner.families.common import ImageSpec


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("w,h", [(640, 480), (300, 500), (256, 256), (224, 224), (230, 1000)])
def test_geometry_is_torchvisions(mode: str, w: int, h: int) -> None:
    spec = ImageSpec(224, 224, 256, mode, None, None, "")
    image = _image(w, h, w * h)
    ours = np.asarray(spec.geometry(image))
    theirs = np.asarray(F.center_crop(F.resize(image, [256], interpolation=InterpolationMode(mode)),
                                      [224, 224]))
    assert ours.shape == theirs.shape == (224, 224, 3)
    assert np.array_equal(ours, theirs)


def test_plain_and_round_trip() -> None:
    image = _image(333, 111, 1)
    pre, mode = build_preprocess("squeezenet1_0", (3, 64, 48))  # non-square: resized to it
    assert mode == "RGB" and pre.spec is not None
    theirs = np.asarray(F.resize(image, [64, 48], interpolation=InterpolationMode.BILINEAR),
                        dtype=np.float32) / 255
    theirs = (theirs - np.asarray(pre.mean)) / np.asarray(pre.std)
    assert np.allclose(pre(image), theirs.transpose(2, 0, 1), atol=1e-6)
    again = ImageSpec.from_json(pre.spec.to_json()).preprocess()
    assert np.array_equal(again(image), pre(image))
