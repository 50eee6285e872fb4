"""Eager torch as a unit runtime: a unit's modules called as the model calls them.

The reference every other runtime is checked against, and the executor's own steps: nothing
to make ahead, nothing kept between calls. A run of several nodes runs them one after the
other (``core.runner.run_node``), each child's output the next one's to write into.
"""

from __future__ import annotations

import torch

from core.runner import run_nodes, run_unit
from core.runtimes import TORCH
from core.runtimes.base import RuntimeOptions
from core.tree import Layer, Node
from core.units import Capture


class EagerUnits:
    """The units of one capture, run by torch."""

    name = TORCH

    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    def prepare(self, nodes: tuple[Node, ...], samples: int) -> None:
        return None

    def call(self, nodes: tuple[Node, ...], x: torch.Tensor, samples: int,
             own: bool = False) -> torch.Tensor:
        if len(nodes) == 1 and isinstance(nodes[0], Layer):
            return run_unit(self.capture, nodes[0], x, in_place=own)
        return run_nodes(self.capture, nodes, x, own)

    @property
    def held_bytes(self) -> int:
        return 0

    @property
    def cached_bytes(self) -> int:
        return 0

    @property
    def making_bytes(self) -> int:
        return 0

    @property
    def making_seen(self) -> float:
        return 0.0

    def give_back(self) -> None:
        return None  # nothing cached of its own: torch's allocator is the device cache's

    def release(self) -> None:
        return None


def load(capture: Capture, options: RuntimeOptions) -> EagerUnits:
    return EagerUnits(capture)
