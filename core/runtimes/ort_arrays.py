"""ONNX Runtime under the plan, on numpy arrays: a model's stored unit graphs
(``core.compiled``) run with no torch in the process.

The same sessions as the torch worker's (``core.runtimes.ort_sessions``: one per run, made
ahead, bound by address); only the buffers differ: numpy arrays, laid out as the walk says
(``workers.array_backend``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from core.errors import ExecutionError
from core.runtimes.base import RuntimeOptions
from core.runtimes.onnx_compose import UnitGraphs
from core.runtimes.ort_sessions import NUMPY, OrtSessions
from core.tree import Node


def cpu_threads() -> int:
    """The cores this process may run on (what torch's default thread count would be)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ArrayUnits(OrtSessions):
    """Sessions for the runs of one stored model, called on numpy arrays (a
    ``core.runtimes.base.UnitRuntime`` whose tensors are arrays)."""

    def __init__(self, graphs: UnitGraphs, threads: int | None = None, *, arena: bool = True,
                 spin: bool = True, max_sessions: int = 128,
                 room: Callable[[], int] | None = None, making_factor: float | None = None) -> None:
        dtype = graphs.shapes.dtype
        if dtype not in NUMPY:
            raise ExecutionError(f"{graphs.shapes.name}: ONNX Runtime's CPU kernels run "
                                 f"float32 here, not {dtype}")
        super().__init__(graphs, threads or cpu_threads(), arena=arena, spin=spin,
                         max_sessions=max_sessions, room=room, making_factor=making_factor)
        self.dtype = np.dtype(NUMPY[dtype])

    def call(self, nodes: tuple[Node, ...], x: np.ndarray, samples: int,
             own: bool = False) -> np.ndarray:
        """One call of the run ``nodes`` on ``x``, into an output of its own."""
        x = np.ascontiguousarray(x, dtype=self.dtype)
        out = np.empty((samples, *self.graphs.shapes.output_of(nodes[-1])), dtype=self.dtype)
        self.run_at(nodes[0].name, nodes[-1].name, self.dtype.type,
                    (x.__array_interface__["data"][0], x.shape),
                    (out.__array_interface__["data"][0], out.shape))
        return out


def load(graphs: UnitGraphs, options: RuntimeOptions) -> ArrayUnits:
    return ArrayUnits(graphs, spin=options.spin, max_sessions=options.max_sessions,
                      room=options.room, arena=options.arena, making_factor=options.making_factor)
