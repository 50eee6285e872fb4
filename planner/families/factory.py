"""Any model as ``package.module:factory``: the factory, called with no arguments, returns the
``nn.Module`` (an ``input_shape`` attribute on it gives the shape it is planned for, else
3x224x224). Nothing of its images or labels is known."""

from __future__ import annotations

import importlib
from typing import Any

from core.errors import ModelError


def names() -> list[str]:
    return []


def knows(name: str) -> bool:
    return ":" in name


def build(name: str) -> Any:
    from torch import nn

    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"cannot import {name!r}: {exc}; give 'package.module:factory' where "
                         "the factory returns an nn.Module") from exc
    try:
        model = factory()
    except Exception as exc:
        raise ModelError(f"the factory {name!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"the factory {name!r} returned {type(model).__name__}, not an nn.Module")
    return model


def input_shape(name: str) -> tuple[int, ...]:
    return (3, 224, 224)


def preprocess(model_name: str, input_shape: tuple[int, int, int]) -> None:
    return None


def labels(model_name: str, classes: int) -> None:
    return None
