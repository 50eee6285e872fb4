"""Unit runtimes: what runs a captured unit, measured and then chosen per step of a plan.

The DP needs only time(u, b) and memory(u, b); it does not care which kernels produced them.
``torch`` runs a unit's modules as the model does (the reference, and where nothing else
can); ``onnxruntime`` runs units exported to ONNX, a run of units at one batch size as one
session (``core.runtimes.onnxrt``). The profile holds every runtime's figures, every step
of a plan names its runtime, and the runtimes and their versions are part of the profile's
fingerprint, so a table is never read for kernels it was not measured on.

This module stays light (no torch, no onnxruntime import): ``vbs solve`` reads plans.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from core.errors import UsageError

TORCH = "torch"
ONNXRUNTIME = "onnxruntime"
RUNTIMES = (TORCH, ONNXRUNTIME)
CHOICES = ("auto", *RUNTIMES)
# A step of a program with no runtime named runs on the unit's default (the profile's
# fastest at that batch size) or, for a profile that names none, on torch.
DEFAULT = ""


def installed() -> tuple[str, ...]:
    """The runtimes this Python can run (torch always)."""
    return tuple(r for r in RUNTIMES if r == TORCH or importlib.util.find_spec(r) is not None)


def version(name: str) -> str:
    """The installed version of a runtime's package."""
    return importlib.metadata.version(name)


def resolve(choice: str) -> tuple[str, ...]:
    """The runtimes to measure for ``--runtime CHOICE``: ``auto`` is every installed one,
    ``onnxruntime`` is it and torch (where it cannot take a unit), ``torch`` is torch."""
    if choice not in CHOICES:
        raise UsageError(f"--runtime {choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "auto":
        return installed()
    if choice == ONNXRUNTIME and ONNXRUNTIME not in installed():
        raise UsageError("--runtime onnxruntime: onnxruntime is not installed here "
                         "(pip install onnxruntime), or use --runtime torch")
    return (TORCH,) if choice == TORCH else (ONNXRUNTIME, TORCH)
