"""Profile a captured model: time(u,b), in(u), out(u), ws(u,b) for every unit and b = 1..B.

measure → discretise → solve are separate steps; this is the first. It runs the network
unit by unit at every batch size of the grid, timing every unit and every join fold in
place, then measures workspaces the same way, and returns a ``Profile`` (schema
vbs.profile/1). Profiles are cached by a fingerprint of everything
that changes the measurement (architecture, input shape, dtype, device, library versions,
batch sizes, repeats), so profiling the same thing twice is a cache hit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from planner.errors import ProfileError, UsageError
from planner.graph.capture import MODULE_GATE, Capture
from planner.graph.runner import run_node
from planner.profiling.grid import batch_grid, fill_time, fill_workspace
from planner.profiling.measure import CudaPeaks, PassTimer, cpu_memory_regions
from planner.solver.memory import allocation, granule_for
from planner.tree import Layer, Node, Parallel, Profile, Series, iter_layers, iter_nodes, \
    load_profile, node_to_json, save_profile

log = logging.getLogger("vbs.profile")


@dataclass(frozen=True)
class ProfileOptions:
    """How to measure: the largest batch, repeats, warm-up runs and whether to use a grid."""

    batch_max: int
    repeats: int = 5
    warmup: int = 2
    grid: bool = False

    def __post_init__(self) -> None:
        if self.batch_max < 1:
            raise UsageError(f"batch max {self.batch_max}: give a whole number >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise UsageError("repeats must be >= 1 and warm-up >= 0")


def device_name(device: torch.device) -> str:
    """A stable name for the hardware a profile is valid on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def fingerprint(capture: Capture, options: ProfileOptions) -> str:
    """A short hash of everything that changes what a profile measures.

    Weights are left out on purpose: time and memory depend on the architecture, not on
    the values, so models that differ only in weights share profiles and tables.
    """
    spec = capture.model.spec
    key = {
        "tree": node_to_json(capture.tree, measured=False),
        "model": spec.name, "input_shape": list(capture.input_shape), "dtype": spec.dtype,
        "device": device_name(capture.model.device), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if capture.model.device.type == "cuda" else None,
        "batch_max": options.batch_max, "grid": options.grid, "repeats": options.repeats,
    }
    blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _fill(node: Node, times: dict[str, list[float]], ws: dict[str, list[int]]) -> Node:
    if isinstance(node, Layer):
        return dataclasses.replace(node, time=tuple(times[node.name]), ws=tuple(ws[node.name]))
    if isinstance(node, Series):
        return dataclasses.replace(node, children=tuple(_fill(c, times, ws) for c in node.children))
    return dataclasses.replace(node, time=tuple(times[node.name]),
                               branches=tuple(_fill(b, times, ws) for b in node.branches))


def measure(capture: Capture, options: ProfileOptions, progress: bool = True) -> Profile:
    """Measure every unit and join of ``capture`` at every batch size of the grid.

    Units are measured where they run: in passes through the whole network at batch b (the
    reference runner), timing each unit and each fold in place, so every unit sees inputs
    fresh from the unit before it and weights as cold as in a real run (timed alone and
    repeated, a unit finds its weights in cache and looks faster than it is), and the
    regions add up to the whole pass (see PassTimer). Passes go round-robin over the batch
    sizes, so drift hits all of them alike.
    """
    device = capture.model.device
    grid = batch_grid(options.batch_max, options.grid)
    started = time.perf_counter()
    layers = list(iter_layers(capture.tree))
    blocks = [n for n in iter_nodes(capture.tree) if isinstance(n, Parallel)]
    inputs = {b: capture.model.example(b, seed=b) for b in grid}
    timer = PassTimer(device)
    samples: dict[str, dict[int, list[float]]] = {}
    passes = (options.warmup + options.repeats) * len(grid)
    per_pass = len(layers)  # the bar counts unit runs: units x batch sizes x repeats
    bar = tqdm(total=(passes + len(grid)) * per_pass, desc=f"profiling {capture.model.spec.name}",
               unit="unit", disable=not progress, leave=False)
    try:
        with torch.inference_mode():
            for k in range(options.warmup + options.repeats):
                for b in grid:
                    timer.start()
                    with MODULE_GATE.running():  # per pass: a trace elsewhere waits one pass
                        run_node(capture, capture.tree, inputs[b], timer)
                    for name, seconds in timer.results().items():
                        if k >= options.warmup:
                            samples.setdefault(name, {}).setdefault(b, []).append(seconds)
                    bar.update(per_pass)
            peaks: dict[str, dict[int, int]] = {}
            if device.type == "cuda":
                for b in grid:
                    cuda = CudaPeaks(device)
                    with MODULE_GATE.running():
                        run_node(capture, capture.tree, inputs[b], cuda)
                    for name, peak in cuda.peaks.items():
                        peaks.setdefault(name, {})[b] = peak
                    bar.update(per_pass)
            else:
                def body(region: Callable[[str], Any]) -> None:
                    for b in grid:
                        with MODULE_GATE.running():
                            run_node(capture, capture.tree, inputs[b],
                                     lambda name: region(f"{name}|{b}"))
                        bar.update(per_pass)
                for label, peak in cpu_memory_regions(body).items():
                    name, b = label.rsplit("|", 1)
                    peaks.setdefault(name, {})[int(b)] = peak
    except torch.cuda.OutOfMemoryError as exc:  # = torch.OutOfMemoryError (torch >= 2.5)
        raise ProfileError(f"out of memory running batch {options.batch_max} on {device}: "
                           "profile with a smaller --batch-max") from exc
    finally:
        bar.close()
    times = {name: {b: statistics.median(ts) for b, ts in per.items()} for name, per in samples.items()}
    for block in blocks:  # a block with only identity branches folds nothing timed
        times.setdefault(block.name, {b: 0.0 for b in grid})
    out_bytes = {n.name: n.out_bytes for n in layers}
    granule = granule_for(device.type)
    # Workspace = what the unit needs at its peak beyond its own output (its input was held),
    # the output counted as the allocator rounds it, as the executor's walk counts it.
    ws = {n.name: fill_workspace({b: max(0, p - allocation(out_bytes[n.name] * b, granule))
                                  for b, p in peaks.get(n.name, {b: 0 for b in grid}).items()},
                                 options.batch_max) for n in layers}
    filled = {name: fill_time(per, options.batch_max) for name, per in times.items()}
    root = _fill(capture.tree, filled, ws)
    assert isinstance(root, Series)
    spec = capture.model.spec
    meta = {
        "model": spec.name, "input_shape": list(capture.input_shape), "dtype": spec.dtype,
        "device": device.type, "device_name": device_name(device), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "batch_sizes_measured": grid, "interpolated": options.grid, "repeats": options.repeats,
        "warmup": options.warmup, "threads": torch.get_num_threads(),
        "units": len(layers), "parallel_blocks": len(blocks), "alloc_granule": granule,
        "fingerprint": fingerprint(capture, options),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - started, 2),
    }
    return Profile(batch_max=options.batch_max, root=root, meta=meta)


def cached_profile(capture: Capture, options: ProfileOptions, cache_dir: Path,
                   progress: bool = True) -> tuple[Profile, bool]:
    """The profile of ``capture`` from the cache, or measured and cached; (profile, hit)."""
    fp = fingerprint(capture, options)
    path = cache_dir / f"{fp}.json"
    if path.exists():
        try:
            profile = load_profile(path)
        except ProfileError as exc:
            log.warning("ignoring unreadable cached profile %s: %s", path, exc)
        else:
            log.info("profile cache hit: %s", path)
            return profile, True
    profile = measure(capture, options, progress=progress)
    try:
        save_profile(profile, path)
    except OSError as exc:
        log.warning("could not cache the profile at %s: %s", path, exc)
    return profile, False
