"""A model family's serving side (``planner.families``): a torchvision model gets its weights'
transforms and ImageNet labels, a model no family knows a plain resize and no labels, a model
whose input is not one image no preprocessing; importing the families loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from planner.families import build_preprocess, labels_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_torchvision_model_gets_its_weights_transforms_and_labels() -> None:
    found = build_preprocess("resnet50", (3, 160, 160))
    assert found is not None
    pre, mode = found
    assert mode == "RGB"
    assert pre(Image.new("RGB", (300, 200))).shape == (3, 160, 160)
    labels = labels_for("resnet50", 1000)
    assert labels is not None and labels[0] == "tench"
    assert labels_for("resnet50", 10) is None  # not the weights' classes: unlabelled


def test_other_models_get_a_plain_resize_or_nothing() -> None:
    found = build_preprocess("tests.planner.factories:two_layer", (1, 8, 8))
    assert found is not None
    pre, mode = found
    assert mode == "L"
    x = pre(Image.new("L", (20, 10), 255))
    assert x.shape == (1, 8, 8) and np.allclose(x, 1.0)
    assert labels_for("tests.planner.factories:two_layer", 10) is None
    assert build_preprocess("c3d", (3, 16, 112, 112)) is None  # video: no images
    assert build_preprocess("resnet50", (2, 224, 224)) is None  # neither gray nor RGB


def test_importing_the_families_loads_no_torch() -> None:
    code = "import sys, json, planner.families; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert not loaded & {"torch", "torchvision"}
