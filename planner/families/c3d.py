"""The built-in C3D video network (``planner.c3d``) as a family: built by its name, ``c3d``,
for clips of 16 frames of 112x112. Its input is no image: no preprocessing, no labels."""

from __future__ import annotations

from typing import Any

VIDEO_SHAPE = (3, 16, 112, 112)


def names() -> list[str]:
    return ["c3d"]


def knows(name: str) -> bool:
    return name == "c3d"


def build(name: str) -> Any:
    from planner.c3d import c3d

    return c3d()


def input_shape(name: str) -> tuple[int, ...]:
    return VIDEO_SHAPE


def preprocess(model_name: str, input_shape: tuple[int, int, int]) -> None:
    return None


def labels(model_name: str, classes: int) -> None:
    return None
