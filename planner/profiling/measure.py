"""The instruments of the profiler: timers and memory peaks of named regions of a pass.

Time: CUDA events on GPU, ``perf_counter`` on CPU. Workspace: on CUDA the peak allocated while
a region runs beyond what was allocated before it (``max_memory_allocated``, which includes
cuDNN's workspace); on CPU the torch profiler's memory events (planner.profiling.cpu_memory),
all regions in one profiling session.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from planner.profiling.cpu_memory import region_peaks

REGION = "vbs::"
RTOL = {torch.float32: 1e-4}  # another runtime's output against torch's; 1e-2 for 16 bits


def differs(got: torch.Tensor, want: torch.Tensor, values: bool = True) -> str:
    """Why ``got`` is not ``want`` within the dtype's tolerance ('' when it is); without
    ``values``, only its shape (an int8 unit's values are the guard's: ``planner.precision``)."""
    if got.shape != want.shape:
        return f"its output has shape {tuple(got.shape)}, torch's {tuple(want.shape)}"
    if not values:
        return ""
    scale = float(want.abs().max()) if want.numel() else 0.0
    rtol = RTOL.get(want.dtype, 1e-2)
    error = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    if error != error or error > rtol * max(scale, 1e-6):
        return (f"its outputs differ from torch's by {error:.3g} (tolerance {rtol:g} x "
                f"{scale:.3g})")
    return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PassTimer:
    """Splits the wall time of one pass through the network among its named regions.

    Each region is charged from the end of the region before it (or the start of the pass)
    to its own end, so everything the pass spends between units (freeing the activation a
    unit no longer needs, allocating a join buffer, Python between calls) is charged to the
    unit that follows, and the regions add up to the whole pass, as they do when a plan runs.
    CPU: ``perf_counter``; CUDA: one event at each region's end, read after the pass.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._times: dict[str, float] = {}
        self._events: list[tuple[str, Any]] = []
        self._last: Any = None

    def start(self) -> None:
        """Mark the start of a pass."""
        self._times, self._events = {}, []
        if self.device.type == "cuda":
            self._last = torch.cuda.Event(enable_timing=True)
            self._last.record()
        else:
            self._last = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        yield
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((name, end))
        else:
            now = time.perf_counter()
            self._times[name] = self._times.get(name, 0.0) + now - self._last
            self._last = now

    def results(self) -> dict[str, float]:
        """Seconds per name for the pass."""
        out = dict(self._times)
        if self._events:
            _sync(self.device)
            last = self._last
            for name, end in self._events:
                out[name] = out.get(name, 0.0) + last.elapsed_time(end) / 1e3
                last = end
        return out


class CudaPeaks:
    """The peak allocated inside each named region beyond what was allocated before it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        _sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        yield
        _sync(self.device)
        self.peaks[name] = max(0, int(torch.cuda.max_memory_allocated(self.device) - base))


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Kineto prints start/stop lines (and a CUDA probe error) on fd 2 from C++: hide them."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_memory_regions(body: Callable[[Callable[[str], Any]], None]) -> dict[str, int]:
    """Run ``body(region)`` in one torch profiler session; ``region(label)`` is a context that
    marks a region; returns the peak bytes allocated inside every region, by label."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_silenced():
        prof.start()
    try:
        with torch.inference_mode():
            body(lambda label: record_function(REGION + label))
    finally:
        with _native_stderr_silenced():
            prof.stop()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="vbs-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return {k[len(REGION):]: v for k, v in region_peaks(events, REGION).items()}


def cpu_peaks(jobs: Iterable[tuple[str, Callable[[Any], Any], Callable[[], Any]]]) -> dict[str, int]:
    """Peak bytes of every job ``(label, run, prepare)``; ``prepare`` runs outside the region."""
    def body(region: Callable[[str], Any]) -> None:
        for label, run, prepare in jobs:
            arg = prepare()
            with region(label):
                out = run(arg)
            del out, arg
    return cpu_memory_regions(body)
