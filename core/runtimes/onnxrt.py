"""ONNX Runtime under the plan, on torch tensors: the sessions of ``core.runtimes.ort_sessions``
bound to the executor's own tensors, so the walk's accounting of activations holds for them.

Why two modules: the sessions, their threads and their memory need no torch, and a worker that
serves stored graphs (``core.compiled``) runs them on numpy arrays
(``core.runtimes.ort_arrays``); this one adds what a captured torch model needs: its units
exported here (``core.runtimes.onnx_graphs``), outputs as torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.errors import ExecutionError
from core.runtimes.base import RuntimeOptions
from core.runtimes.onnx_graphs import UnitGraphs, export_units
from core.runtimes.ort_sessions import (NAME, NUMPY, SESSION_GROWTH, SPIN, STOP, VERSION,
                                        OrtSessions, session_options, weight_bytes)
from core.tree import Node, Parallel
from core.units import Capture

__all__ = ["NAME", "VERSION", "SESSION_GROWTH", "SPIN", "STOP", "OrtUnits", "load", "providers",
           "session_options", "unavailable"]
_weight_bytes = weight_bytes  # the name the tests of the bound know it by


def providers(device: torch.device) -> list[str]:
    """The execution providers for ``device``."""
    return ["CPUExecutionProvider"]


def unavailable(capture: Capture) -> str:
    """Why ONNX Runtime cannot run this model here at all ('' when it can)."""
    device = capture.model.device
    if device.type != "cpu":
        return (f"ONNX Runtime runs units on the CPU only here (its memory on {device.type} "
                "is not measured); torch runs them")
    if capture.model.spec.dtype not in NUMPY:
        return f"its CPU kernels run float32 here, not {capture.model.spec.dtype}"
    return ""


class OrtUnits(OrtSessions):
    """Sessions for the runs of one captured model (a ``core.runtimes.base.UnitRuntime``);
    ``run`` computes a run into a buffer."""

    def __init__(self, capture: Capture, graphs: UnitGraphs | None = None,
                 threads: int | None = None, *, arena: bool = True, spin: bool = True,
                 max_sessions: int = 128, room: Callable[[], int] | None = None,
                 making_factor: float | None = None) -> None:
        why = unavailable(capture)
        if why:
            raise ExecutionError(f"{capture.model.spec.name}: ONNX Runtime cannot run it: {why}")
        if graphs is None:  # the planner's (int8 units quantized), else exported now
            graphs = capture.graphs if capture.graphs is not None else export_units(capture)
        super().__init__(graphs,
                         threads or torch.get_num_threads(), arena=arena, spin=spin,
                         max_sessions=max_sessions, room=room, making_factor=making_factor)
        self.capture = capture
        self.device = capture.model.device
        self._dtype = NUMPY[capture.model.spec.dtype]

    def call(self, nodes: tuple[Node, ...], x: torch.Tensor, samples: int,
             own: bool = False) -> torch.Tensor:
        """One call of the run ``nodes`` on ``x``, into an output of its own."""
        out = self.output(nodes[-1], x, samples)
        # views along the batch of the walk's chunks are contiguous, and a unit whose input
        # is not dense in the model does not run on ONNX Runtime (planner.profiling.ort)
        return self.run(nodes[0].name, nodes[-1].name, x.contiguous(), out)

    def run(self, first: str, last: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Run ``first..last`` on ``x`` (contiguous) writing ``out`` (contiguous, allocated by
        the caller for the run's output); returns ``out``."""
        self.run_at(first, last, self._dtype, (x.data_ptr(), tuple(x.shape)),
                    (out.data_ptr(), tuple(out.shape)))
        return out

    def output(self, last: Node, like: torch.Tensor, samples: int) -> torch.Tensor:
        """A contiguous buffer for the output of a run that ends with ``last``."""
        shape = (self.capture.joins[last.name].out_shape if isinstance(last, Parallel)
                 else self.capture.units[last.name].out_shape)
        return torch.empty((samples, *shape), dtype=like.dtype, device=like.device)


def load(capture: Capture, options: RuntimeOptions) -> OrtUnits:
    return OrtUnits(capture, spin=options.spin, max_sessions=options.max_sessions,
                    room=options.room, arena=options.arena, making_factor=options.making_factor)
