"""Unit runtimes: what runs a captured unit, measured and then chosen per step of a plan.

The DP needs only time(u, b) and memory(u, b); it does not care which kernels produced them.
``torch`` runs a unit's modules as the model does (the reference, and where nothing else
can); ``onnxruntime`` runs units exported to ONNX, a run of units at one batch size as one
session (``core.runtimes.onnxrt``); ``cudagraph`` captures a run at one batch size as a CUDA
graph and replays it (``core.runtimes.cudagraph``). The profile holds every runtime's
figures, every step of a plan names its runtime, and the runtimes and their versions are
part of the profile's fingerprint, so a table is never read for kernels it was not measured
on.

Every runtime is one module here with a ``load(capture, options)`` that gives a
``UnitRuntime`` (``core.runtimes.base``), and where it runs a model compiled into the store
without torch, a module whose ``load(graphs, options)`` does so; the executor, the worker and
the registry use only that interface, through ``load`` and ``load_compiled`` below. Its
measurement lives in ``planner/profiling/``.

This module stays light (no torch, no onnxruntime import): ``vbs solve`` reads plans.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import UsageError

if TYPE_CHECKING:
    from core.runtimes.base import RuntimeOptions, UnitRuntime
    from core.runtimes.onnx_compose import UnitGraphs
    from core.units import Capture

TORCH = "torch"
ONNXRUNTIME = "onnxruntime"
CUDAGRAPH = "cudagraph"
RUNTIMES = (TORCH, ONNXRUNTIME, CUDAGRAPH)
CHOICES = ("auto", *RUNTIMES)
# A step of a program with no runtime named runs on the unit's default (the profile's
# fastest at that batch size) or, for a profile that names none, on torch.
DEFAULT = ""


@dataclass(frozen=True)
class Kind:
    """What the rest of the code needs to know of a runtime without loading it."""

    name: str
    module: str              # the module whose ``load(capture, options)`` makes its units
    package: str             # the distribution it needs installed (its version is the runtime's)
    devices: tuple[str, ...]  # the device types it runs units on
    # it runs a run of units (consecutive children of one series at one batch size) as one
    # call, which the DP prices whole (``planner.solver.model.RunTable``); else the executor
    # runs each of its units as a step of its own
    calls: bool
    # its calls may run the model's torch modules (a CUDA graph's capture does), so they
    # never run beside a torch.fx trace (``core.units.MODULE_GATE``)
    modules: bool = True
    # the module whose ``load(graphs, options)`` runs a compiled model's unit graphs on numpy
    # arrays, with no torch in the process ('': it needs the torch model)
    compiled: str = ""


KINDS = {
    TORCH: Kind(TORCH, "core.runtimes.eager", "torch", ("cpu", "cuda"), calls=False),
    ONNXRUNTIME: Kind(ONNXRUNTIME, "core.runtimes.onnxrt", "onnxruntime", ("cpu",), calls=True,
                        modules=False, compiled="core.runtimes.ort_arrays"),
    CUDAGRAPH: Kind(CUDAGRAPH, "core.runtimes.cudagraph", "torch", ("cuda",), calls=True),
}


def installed() -> tuple[str, ...]:
    """The runtimes this Python can load (torch's always)."""
    return tuple(r for r in RUNTIMES if KINDS[r].package == "torch"
                 or importlib.util.find_spec(KINDS[r].package) is not None)


def version(name: str) -> str:
    """The installed version of a runtime's package."""
    return importlib.metadata.version(KINDS[name].package)


def resolve(choice: str, device: str = "cpu") -> tuple[str, ...]:
    """The runtimes to measure for ``--runtime CHOICE`` on a device type (``cpu``, ``cuda``):
    ``auto`` is every installed one that runs there, a named one is it and torch (where it
    cannot take a unit), ``torch`` is torch."""
    if choice not in CHOICES:
        raise UsageError(f"--runtime {choice!r}: use one of {', '.join(CHOICES)}")
    device = device.split(":", 1)[0]
    if choice == "auto":
        return tuple(r for r in installed() if device in KINDS[r].devices)
    if choice == TORCH:
        return (TORCH,)
    if choice not in installed():
        raise UsageError(f"--runtime {choice}: {KINDS[choice].package} is not installed here "
                         f"(pip install {KINDS[choice].package}), or use --runtime torch")
    if choice == CUDAGRAPH and device != "cuda":
        raise UsageError("--runtime cudagraph: CUDA graphs run on a CUDA device; give "
                         "--device cuda, or use --runtime auto or torch")
    return (choice, TORCH)


def grouping(names: tuple[str, ...]) -> str:
    """The one runtime among ``names`` that runs units in calls of runs ('' for none); two
    such runtimes never run one model (each runs on a device type the other does not)."""
    calls = [r for r in names if KINDS[r].calls] if names else []
    if len(calls) > 1:
        raise UsageError(f"runtimes {', '.join(calls)} both run units in calls; a profile "
                         "measures one of them (give --runtime)")
    return calls[0] if calls else ""


def load(name: str, capture: "Capture", options: "RuntimeOptions") -> "UnitRuntime":
    """The units of ``capture`` on runtime ``name`` (its module loaded only now)."""
    kind = KINDS.get(name)
    if kind is None:
        raise UsageError(f"no unit runtime {name!r}: use one of {', '.join(RUNTIMES)}")
    return importlib.import_module(kind.module).load(capture, options)  # type: ignore[no-any-return]


def load_compiled(name: str, graphs: "UnitGraphs", options: "RuntimeOptions") -> "UnitRuntime":
    """The units of a compiled model (its stored unit graphs) on runtime ``name``, on numpy
    arrays, without torch."""
    kind = KINDS.get(name)
    if kind is None or not kind.compiled:
        runs = ", ".join(k.name for k in KINDS.values() if k.compiled)
        raise UsageError(f"{graphs.shapes.name}: a worker without torch runs {runs} only, not "
                         f"{name}: plan it with --runtime {runs}, or serve it with torch")
    return importlib.import_module(kind.compiled).load(graphs, options)  # type: ignore[no-any-return]
