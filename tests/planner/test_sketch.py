"""A model weighed without loading it (``planner.models.sketch_model``): built on the meta
device, what its weights take in the spec's dtype and its output shape, and a weights file
checked against it on meta too (what ``load_model`` would refuse, refused without the memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.errors import ModelError
from core.loaded import ModelSpec
from planner.models import load_model, sketch_model


def test_the_sketch_weighs_what_loading_allocates() -> None:
    spec = ModelSpec("squeezenet1_0", input_shape=(3, 64, 64))
    sketch = sketch_model(spec)
    module = load_model(spec).module
    loaded = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    assert sketch.weights_bytes == loaded
    assert sketch.input_shape == (3, 64, 64) and sketch.output_shape == (1000,)
    half = sketch_model(ModelSpec("squeezenet1_0", input_shape=(3, 64, 64), dtype="float16"))
    assert half.weights_bytes == loaded // 2


def test_a_factory_model_gets_its_default_shape() -> None:
    sketch = sketch_model(ModelSpec("tests.planner.factories:two_layer"))
    assert sketch.input_shape == (3, 224, 224) and sketch.output_shape == (4, 224, 224)


def test_a_weights_file_that_does_not_fit_is_refused_on_meta(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    state = load_model(ModelSpec("tests.planner.factories:two_layer")).module.state_dict()
    torch.save(state, good)
    torch.save({k: v for k, v in list(state.items())[1:]}, bad)
    spec = ModelSpec("tests.planner.factories:two_layer", weights=good)
    assert sketch_model(spec, check_weights=True).weights_bytes > 0
    with pytest.raises(ModelError, match="do not fit the model"):
        sketch_model(ModelSpec("tests.planner.factories:two_layer", weights=bad),
                     check_weights=True)
    with pytest.raises(ModelError, match="no weights file"):
        sketch_model(ModelSpec("tests.planner.factories:two_layer",
                               weights=tmp_path / "none.pt"), check_weights=True)


def test_every_torchvision_model_is_weighed_without_loading_it() -> None:
    """A server weighs every model it is given before it loads any (and refuses to start on a
    model that cannot load): the sketch is a shortcut and must never refuse a model that loads.
    RegNets compute their widths with tensors, which the meta device cannot read: built on the
    CPU with their weights left unset, they weigh what loading them allocates."""
    from planner.families.torchvision import names

    refused = {}
    for name in names():
        try:
            assert sketch_model(ModelSpec(name)).weights_bytes > 0
        except Exception as exc:  # noqa: BLE001 - every refusal is reported
            refused[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    assert not refused, refused
    spec = ModelSpec("regnet_y_400mf", input_shape=(3, 64, 64))
    sketch = sketch_model(spec, check_weights=True)
    module = load_model(spec).module
    assert sketch.weights_bytes == sum(t.numel() * t.element_size()
                                       for t in (*module.parameters(), *module.buffers()))
    assert sketch.output_shape == (1000,)
    assert all(p.abs().sum() > 0 for p in module.parameters() if p.dim() > 1)  # init kept
