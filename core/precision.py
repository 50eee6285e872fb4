"""A model's precision: which of its units ONNX Runtime runs in int8, or whether torch runs the
whole model in a half precision (bfloat16, float16), and what that costs the answer, as
measured where it was chosen.

Why a record of its own: the planner chooses it once (``planner.precision``: calibration,
quantized unit graphs, the error guard), and everything after reads it: the profile's
fingerprint (int8 units are other kernels), the table and the compiled model (what
`vbs show`, `/plan` and `/models` say), and the selection's check of a plan's output against
``model(x)``, which int8 units move by what the guard measured. No torch, no onnxruntime: a
worker without torch reads it from the compiled model's meta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import UsageError

FLOAT32 = "float32"
INT8 = "int8"
BFLOAT16 = "bfloat16"
FLOAT16 = "float16"
HALF = (BFLOAT16, FLOAT16)  # what torch runs a whole model at, where it has the kernels
AUTO = "auto"
CHOICES = (AUTO, FLOAT32, INT8, BFLOAT16, FLOAT16)

# a plan's output may differ from model(x) by this, relative to its scale (float32 kernels
# of two runtimes, or two batch sizes' kernels)
FLOAT_TOLERANCE = 1e-3
# ... and where the model runs at a half precision (8 or 11 bits of mantissa: two batch sizes'
# kernels part by as much as the arithmetic allows, ``planner.graph.inspect.arithmetic_tolerance``)
HALF_TOLERANCE = 1e-2
# a plan mixing int8 units with float32 ones where the guard measured the model all int8 on
# ONNX Runtime: its outputs may differ from model(x) by this many times what the guard saw
GUARD_SLACK = 3.0


@dataclass(frozen=True)
class Precision:
    """What a model's ONNX Runtime units run at, and the error that was measured of it.

    ``int8`` lists the units (by name) whose graphs are quantized (static QDQ, per-channel
    weights); every other unit, every join and everything torch runs stays float32.
    ``dtype`` bfloat16 or float16 (``HALF``): torch runs every unit and join at it (its
    weights cast once, the model captured at that dtype; ONNX Runtime has no bfloat16 CPU
    kernels, and a CUDA model's units are torch's), ``int8`` empty.
    ``agreement``: the share of held-out calibration samples whose top-1 class is float32's
    with every int8 unit on; ``error``: the largest difference of their outputs, relative
    to float32's scale (as the selection's check reads it); ``held_out``: how many samples.
    ``why``: what the choice was, in words (a user asked for float32, auto had no calibration
    data, the guard kept units float32, int8 ran slower here); ``speedup``: float32's time
    over int8's (or the half precision's) for the whole model on this machine
    (``planner.precision_speed``; 0: not measured)."""

    int8: tuple[str, ...] = ()
    calibration: str = ""  # digest of the calibration samples
    agreement: float = 1.0
    error: float = 0.0
    held_out: int = 0
    max_error: float = 0.0
    why: str = ""
    # float32's time over int8's, one call of the whole model on ONNX Runtime per sample at
    # one sample and at a batch, measured where it was chosen (0: not measured)
    speedup: float = 0.0
    dtype: str = FLOAT32  # what torch runs the model at: float32, or one of HALF throughout

    @property
    def half(self) -> bool:
        """Whether torch runs the whole model at a half precision (``dtype``)."""
        return self.dtype in HALF

    @property
    def name(self) -> str:
        if self.half:
            return self.dtype
        return INT8 if self.int8 else FLOAT32

    @property
    def chosen(self) -> bool:
        """Whether anything runs at another precision than float32."""
        return self.name != FLOAT32

    def of(self, unit: str, onnxruntime: bool = True) -> str:
        """The precision unit ``unit`` runs at (``onnxruntime``: on ONNX Runtime, where its
        int8 graph runs; torch runs an int8 unit's modules in float32)."""
        if self.half:
            return self.dtype
        return INT8 if onnxruntime and unit in self.int8 else FLOAT32

    @property
    def tolerance(self) -> float:
        """How far a plan's output may be from ``model(x)``, relative to its scale."""
        base = HALF_TOLERANCE if self.half else FLOAT_TOLERANCE
        return base + GUARD_SLACK * self.error

    def fingerprint_key(self) -> dict[str, Any] | None:
        """What changes the kernels a profile measures, or what the guard measured them on
        (None for float32: older fingerprints stay as they were)."""
        if self.half:
            return {"dtype": self.dtype, "calibration": self.calibration}
        if not self.int8:
            return None
        return {"int8": sorted(self.int8), "calibration": self.calibration}

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.name, "int8": list(self.int8), "calibration": self.calibration,
                "agreement": self.agreement, "error": self.error, "held_out": self.held_out,
                "max_error": self.max_error, "why": self.why, "speedup": self.speedup,
                "dtype": self.dtype}

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Precision:
        if not raw:
            return FLOAT
        return cls(tuple(raw.get("int8", ())), str(raw.get("calibration", "")),
                   float(raw.get("agreement", 1.0)), float(raw.get("error", 0.0)),
                   int(raw.get("held_out", 0)), float(raw.get("max_error", 0.0)),
                   str(raw.get("why", "")), float(raw.get("speedup", 0.0)),
                   str(raw.get("dtype", FLOAT32)))


FLOAT = Precision()


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise UsageError(f"--precision {choice!r}: use one of {', '.join(CHOICES)}")
    return choice
