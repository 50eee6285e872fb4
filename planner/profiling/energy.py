"""Energy per unit and batch size, for tables planned for energy (``VBS_OBJECTIVE=energy``).

The profile carries it per layer (``Layer.energy``: joules for b samples at once, b = 1..B), and
the DP minimises it like time. It cannot be measured as time is (``PassTimer``: each unit in
place, in passes through the network): a device's energy counter ticks far more coarsely than
a unit runs. So each (unit, b) runs alone, on the input a real pass gives it, repeated for a
window of several ticks, read between two ticks of the counter, with the idle power of the
wait for the closing tick taken off. The batch sizes measured are a few (``energy_grid``), the
rest interpolated as time is on a grid.

The counter: NVML's total energy of the board (``nvmlDeviceGetTotalEnergyConsumption``, every
NVIDIA GPU since Volta; ``nvidia-ml-py`` provides ``pynvml``). A CPU has none here, so CPU
profiles carry no energy and a table for energy needs a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from core.errors import ProfileError
from core.units import MODULE_GATE, Capture
from core.runner import run_node, run_unit
from planner.profiling.grid import fill_time
from core.tree import Layer, Node, Parallel, Profile, Series

# A counter that ticks more often than this is read as continuous: no waiting for ticks.
CONTINUOUS_S = 1e-3


class Counter(Protocol):
    """A cumulative counter: ``read()`` grows with what was spent since some origin."""

    name: str
    unit: str  # of what ``read`` returns: "J" for energy

    def read(self) -> float: ...


class NvmlCounter:
    """The board energy of one CUDA device, in joules, from NVML."""

    unit = "J"

    def __init__(self, device: torch.device) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ProfileError("measuring energy on CUDA needs NVML's Python binding: "
                               "pip install nvidia-ml-py") from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.read()
        except pynvml.NVMLError as exc:
            raise ProfileError(f"NVML cannot read the energy counter of {device} ({exc}): it "
                               "needs an NVIDIA driver and a GPU of Volta or later") from exc
        self.name = f"NVML total energy ({name.decode() if isinstance(name, bytes) else name})"

    def read(self) -> float:
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)) / 1e3


def _nvml_index(device: torch.device) -> int:
    """NVML's index of a torch CUDA device (they differ under CUDA_VISIBLE_DEVICES)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mapper = getattr(torch.cuda, "_get_nvml_device_index", None)
    return int(mapper(index)) if mapper is not None else int(index)


@dataclass(frozen=True)
class Clock:
    """How a counter ticks: seconds between its updates and what it gains per second idle."""

    tick_s: float
    idle_per_s: float

    @property
    def continuous(self) -> bool:
        return self.tick_s < CONTINUOUS_S


def _edge(counter: Counter, timeout_s: float) -> tuple[float, float]:
    """Wait for the counter's next update: (value, perf_counter time) just after it."""
    start = counter.read()
    deadline = time.perf_counter() + timeout_s
    while True:
        value, now = counter.read(), time.perf_counter()
        if value != start or now > deadline:
            return value, now


def calibrate(counter: Counter, seconds: float = 1.0) -> Clock:
    """The counter's tick and idle rate, read for ``seconds`` with the device idle."""
    value, now = _edge(counter, seconds)
    first_v, first_t = value, now
    gaps: list[float] = []
    while now - first_t < seconds:
        last = now
        value, now = _edge(counter, seconds)
        if len(gaps) < 10_000:  # a continuous counter moves at every read
            gaps.append(now - last)
    if value == first_v:  # it never moved: a counter that is not counting
        raise ProfileError(f"{counter.name} did not change in {seconds:g} s: no energy can be "
                           "read from it")
    tick = statistics.median(gaps) if gaps else seconds
    return Clock(tick_s=tick, idle_per_s=(value - first_v) / max(now - first_t, 1e-9))


def energy_grid(batch_max: int) -> list[int]:
    """The batch sizes energy is measured at: powers of two and the largest."""
    sizes = {batch_max}
    b = 1
    while b < batch_max:
        sizes.add(b)
        b *= 2
    return sorted(sizes)


class Meter:
    """What a piece of work spends on a counter: read at the counter's ticks around it, the
    idle spending of the wait for the closing tick taken off (a continuous counter is read
    right before and after)."""

    def __init__(self, counter: Counter, clock: Clock, sync: Callable[[], None]) -> None:
        self.counter, self.clock, self.sync = counter, clock, sync

    def spent(self, work: Callable[[], object]) -> float:
        if self.clock.continuous:
            before = self.counter.read()
            work()
            self.sync()
            return self.counter.read() - before
        wait = 10 * self.clock.tick_s + 1
        start, _ = _edge(self.counter, wait)
        work()
        self.sync()
        ran = time.perf_counter()
        end, at = _edge(self.counter, wait)
        return max(0.0, end - start - self.clock.idle_per_s * (at - ran))


def device_sync(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class _Runner:
    """A ``UnitRunner`` for ``run_node``: every unit run once (its output goes on through the
    pass), timed once more, then repeated alone for a window while the meter reads."""

    def __init__(self, capture: Capture, meter: Meter, window_s: float) -> None:
        self.capture, self.meter, self.window_s = capture, meter, window_s
        self.batch = 0
        self.energy: dict[str, dict[int, float]] = {}

    def __call__(self, unit: Layer, x: torch.Tensor, own: bool) -> torch.Tensor:
        y = run_unit(self.capture, unit, x)  # warm, and the output for the pass
        self.meter.sync()
        t0 = time.perf_counter()
        del y
        y = run_unit(self.capture, unit, x)
        self.meter.sync()
        once = max(time.perf_counter() - t0, 1e-6)
        n = max(1, math.ceil(self.window_s / once))

        def repeat() -> None:
            for _ in range(n):
                run_unit(self.capture, unit, x)  # not in place: x is read again

        self.energy.setdefault(unit.name, {})[self.batch] = self.meter.spent(repeat) / n
        return y  # computed out of place: the same values, whatever ``own`` allows


def measure_units(capture: Capture, counter: Counter, batch_sizes: list[int], *,
                  window_ticks: float = 5.0, min_window_s: float = 0.02,
                  clock: Clock | None = None) -> tuple[dict[str, dict[int, float]], dict[str, Any]]:
    """Energy of one call of every unit at each of ``batch_sizes``, in the counter's unit
    (unit name -> b -> value), and what was done (counter, tick, window, seconds spent)."""
    started = time.perf_counter()
    clock = clock or calibrate(counter)
    window = max(min_window_s, window_ticks * clock.tick_s)
    runner = _Runner(capture, Meter(counter, clock, device_sync(capture.model.device)), window)
    with torch.inference_mode():
        for b in batch_sizes:
            runner.batch = b
            x = capture.model.example(b, seed=b)
            with MODULE_GATE.running():
                run_node(capture, capture.tree, x, runner=runner)
            del x
    meta = {"counter": counter.name, "unit": counter.unit, "tick_s": clock.tick_s,
            "idle_per_s": clock.idle_per_s, "window_s": window,
            "batch_sizes_measured": list(batch_sizes),
            "elapsed_s": round(time.perf_counter() - started, 2)}
    return runner.energy, meta


def with_energy(profile: Profile, energy: dict[str, dict[int, float]], meta: dict[str, Any]
                ) -> Profile:
    """``profile`` with every measured layer's ``energy`` (b = 1..B, interpolated between the
    batch sizes measured) and ``meta["energy"]`` saying how it was measured."""
    B = profile.batch_max

    def fill(node: Node) -> Node:
        if isinstance(node, Layer):
            per = energy.get(node.name)
            return dataclasses.replace(node, energy=tuple(fill_time(per, B))) if per else node
        if isinstance(node, Series):
            return dataclasses.replace(node, children=tuple(fill(c) for c in node.children))
        assert isinstance(node, Parallel)
        return dataclasses.replace(node, branches=tuple(fill(b) for b in node.branches))

    root = fill(profile.root)
    return Profile(batch_max=B, root=root, meta={**profile.meta, "energy": meta})  # type: ignore[arg-type]
