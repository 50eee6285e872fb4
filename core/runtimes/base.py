"""The interface every unit runtime implements, and what the worker tells it when it loads one.

A runtime runs a *run*: consecutive children of one series (``core.runs``) at one batch
size, reading the walk's input and giving an output buffer the walk then owns and frees, so
the activations between calls stay the executor's and the table's accounting holds (a run of
one unit is a step). What a runtime keeps between calls (ONNX Runtime's sessions, CUDA
graphs and their private memory pool) it makes ahead in ``prepare`` and says in
``held_bytes``, and the part of the device allocator's cache it keeps for itself in
``cached_bytes``, a report only (no reading of free device memory counts such bytes as free:
``workers.memory``). What its calls leave cached between them, which the next call would make
again (ONNX Runtime's arena), ``give_back`` returns to the system when the device's memory
owner asks (at rest, when memory is short). ``release`` gives it all back (a table swapped out,
a model unloaded).

Errors: ``core.errors.ExecutionError`` for a run it cannot make, ``OutOfMemoryError`` when
what it would make does not fit in ``RuntimeOptions.room`` (the worker then runs a smaller
plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from core.tree import Node


@dataclass(frozen=True)
class RuntimeOptions:
    """How a worker loads a runtime: ONNX Runtime's session policy (``spin``, the most
    sessions kept, ``arena``), and ``room``, the bytes free now on the runtime's memory, read before
    it makes a session or captures a graph (None: not read)."""

    spin: bool = True
    max_sessions: int = 128
    arena: bool = True  # ONNX Runtime's shared arena; False: what a call allocates goes back
    room: Callable[[], int] | None = None
    # bytes a session asks free per byte of its weights, as `vbs plan` measured the model's
    # (``core.runtimes.ort_sessions.served_factor``); None: the bound where nothing was measured
    making_factor: float | None = None


class UnitRuntime(Protocol):
    """The units of one captured model on one runtime."""

    name: str

    def prepare(self, nodes: tuple[Node, ...], samples: int) -> None:
        """Make what the run of ``nodes`` on ``samples`` samples needs now, not at its first
        call."""

    def call(self, nodes: tuple[Node, ...], x: torch.Tensor, samples: int,
             own: bool = False) -> torch.Tensor:
        """Run ``nodes`` on ``x`` (``samples`` samples) into an output allocated here, which
        the caller then owns; ``own``: nobody else reads ``x`` (a unit that only writes into
        its input may write it)."""

    @property
    def held_bytes(self) -> int:
        """Bytes it keeps between calls, outside any plan."""

    @property
    def cached_bytes(self) -> int:
        """The part of the device allocator's cache it keeps for itself, unused now (a report:
        never counted as free for plans)."""

    @property
    def making_bytes(self) -> int:
        """The most memory it has needed free to make something it then keeps (ONNX Runtime's
        session for a run): what it needs free to make that again; 0 where it makes nothing
        so."""

    @property
    def making_seen(self) -> float:
        """The most making something it keeps grew the process's peak by, per byte of that
        thing's weights (ONNX Runtime's sessions; 0 where it makes nothing so or measured
        none)."""

    def give_back(self) -> None:
        """Give back what its calls leave cached between them, keeping what it holds (may act
        for every runtime of its kind in the process: ONNX Runtime's arena is shared)."""

    def release(self) -> None:
        """Give back everything it keeps."""
