"""What a runtime's call costs beyond its units: one fit for every runtime that runs units in calls.

A call (an ONNX Runtime session's run, a CUDA graph's replay with its copies) costs, beyond
its units' time inside it, a fixed part and a part by the bytes it takes in and gives out:
``call_s + byte_s * (bytes in + bytes out)``. Both are fitted once, by least squares and both
>= 0, to what every unit costs called alone over its time inside a run, at every batch size
measured, so that one noisy batch size does not give its own calls another price.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_call(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(call_s, byte_s) >= 0 that best explain what units cost called alone over their time
    inside a run, ``alone - inside ~ call_s + byte_s * io_bytes``, by least squares over
    ``points`` of (io_bytes, alone - inside): every unit at every batch size measured, so
    that one noisy batch size does not give its own calls another price."""
    if not points:
        return 0.0, 0.0
    y = np.array([extra for _, extra in points])
    a = np.array([float(io) for io, _ in points])
    best = (max(0.0, float(y.mean())), 0.0)
    if float(a.var()) > 0:
        slope, intercept = np.polyfit(a, y, 1)
        if slope >= 0 and intercept >= 0:
            return float(intercept), float(slope)
        if slope >= 0:  # the fixed cost at 0: fit the slope through the origin
            through = max(0.0, float(a @ y / (a @ a)))
            if _sse(y, a, 0.0, through) < _sse(y, a, *best):
                best = (0.0, through)
    return best


def _sse(y: np.ndarray, a: np.ndarray, call: float, per_byte: float) -> float:
    return float(((y - call - per_byte * a) ** 2).sum())
