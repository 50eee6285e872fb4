"""Profile a captured model: time(u,b), in(u), out(u), ws(u,b) for every unit and b = 1..B.

measure → discretise → solve are separate steps; this is the first. It runs the network
unit by unit at every batch size of the grid, timing every unit and every join fold in
place, on every unit runtime asked for (``core.runtimes``: torch, and ONNX Runtime where
it takes the unit), then measures workspaces, and returns a ``Profile`` (schema
vbs.profile/1) whose ``time``/``ws`` are, per unit and batch size, the fastest runtime's.
Profiles are cached by a fingerprint of everything that changes the measurement
(architecture, input shape, dtype, device, runtimes and library versions, batch sizes,
repeats), so profiling the same thing twice is a cache hit.
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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from core import runtimes
from core.errors import ProfileError, UsageError, VbsError
from core.units import MODULE_GATE, Capture
from core.runner import UnitRunner, run_node
from planner.profiling.grid import batch_grid, fill_time, fill_workspace
from planner.profiling.measure import CudaPeaks, PassTimer, cpu_memory_regions
from planner.profiling.takes import for_layout, lifted
from core.sizes import allocation, granule_for
from core.tree import Layer, Measured, Node, Parallel, Profile, Series, iter_layers, \
    iter_nodes, load_profile, node_to_json, save_profile

log = logging.getLogger("vbs.profile")


@dataclass(frozen=True)
class ProfileOptions:
    """How to measure: the largest batch, repeats, warm-up runs, whether to use a grid, and
    the unit runtimes (``core.runtimes.CHOICES``: auto, torch, onnxruntime or cudagraph)."""

    batch_max: int
    repeats: int = 5
    warmup: int = 2
    grid: bool = False
    runtime: str = runtimes.TORCH
    # for the worker without torch: every step runs on ONNX Runtime, so the units refused only
    # beside torch (their layout, ``planner.profiling.takes.LAYOUT``) are taken too
    lean: bool = False

    def __post_init__(self) -> None:
        if self.batch_max < 1:
            raise UsageError(f"batch max {self.batch_max}: give a whole number >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise UsageError("repeats must be >= 1 and warm-up >= 0")
        if self.runtime not in runtimes.CHOICES:
            runtimes.resolve(self.runtime)  # the UsageError that names the choices

    def runtimes_on(self, device: torch.device) -> tuple[str, ...]:
        """The runtimes measured on ``device`` (``core.runtimes.resolve``)."""
        return runtimes.resolve(self.runtime, device.type)


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


# How units are measured (METHOD: the passes, oneDNN's cache; ORT_METHOD: which units ONNX
# Runtime takes, how its runs are timed and its workspace bounded; CUDA_METHOD: the device's
# time apart from the host's, CUDA graphs' runs, ``planner.profiling.cudagraph``): a change
# here changes profiles without changing any version above, so it re-measures cached ones.
METHOD = 2
ORT_METHOD = 9
CUDA_METHOD = 1


def fingerprint(capture: Capture, options: ProfileOptions) -> str:
    """A short hash of everything that changes what a profile measures.

    Weights are left out on purpose: time and memory depend on the architecture, not on
    the values, so models that differ only in weights share profiles and tables.
    """
    spec = capture.model.spec
    measured = options.runtimes_on(capture.model.device)
    key = {
        "tree": node_to_json(capture.tree, measured=False),
        "model": spec.name, "input_shape": list(capture.input_shape), "dtype": spec.dtype,
        "device": device_name(capture.model.device), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if capture.model.device.type == "cuda" else None,
        "batch_max": options.batch_max, "grid": options.grid, "repeats": options.repeats,
        "runtime": options.runtime,
        "runtimes": {name: runtimes.version(name) for name in measured},
        "method": METHOD,
    }
    if options.lean:
        key["lean"] = True
    if capture.model.channels_last:  # other kernels (bfloat16 on the CPU: planner.models)
        key["layout"] = "channels_last"
    if capture.precision.fingerprint_key() is not None:  # int8 units: other kernels
        key["precision"] = capture.precision.fingerprint_key()
    if runtimes.ONNXRUNTIME in measured:
        key["onnxruntime_method"] = ORT_METHOD
    if capture.model.device.type == "cuda":
        key["cuda_method"] = CUDA_METHOD
    blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class _Figures:
    """What one runtime measured: seconds per (node, b) and workspace per (unit, b)."""

    times: dict[str, dict[int, float]]
    ws: dict[str, list[int]]


def _choose(layer: Layer, options: ProfileOptions, figures: dict[str, _Figures],
            unsupported: dict[str, dict[str, str]]) -> Layer:
    """A unit with every runtime's figures and, per b, the runtime its ``time``/``ws`` are
    of: the fastest (``auto``), or the one named wherever it takes the unit (``onnxruntime``,
    ``cudagraph``). Their time is their time inside a run of units
    (``planner.profiling.ort``, ``planner.profiling.cudagraph``)."""
    B = options.batch_max
    name = layer.name
    if len(figures) == 1:  # torch alone: its figures, no runtime named
        only = figures[runtimes.TORCH]
        return dataclasses.replace(layer, time=tuple(fill_time(only.times[name], B)),
                                   ws=tuple(only.ws[name]))
    refused = _refused(name, unsupported, options)
    measured = {rt: Measured(tuple(fill_time(f.times[name], B)), tuple(f.ws[name]))
                for rt, f in figures.items() if rt not in refused or
                for_layout(refused[rt])}  # (measured: kept for the lean tables)
    allowed = {rt: m for rt, m in measured.items() if rt not in refused}
    return dataclasses.replace(_chosen(layer, allowed, options.runtime, B, measured),
                               unsupported=tuple(refused.items()))


def _refused(name: str, unsupported: dict[str, dict[str, str]],
             options: ProfileOptions) -> dict[str, str]:
    """Why each runtime cannot take node ``name`` (its layout no reason where ``lean``)."""
    refused = {rt: why[name] for rt, why in unsupported.items() if name in why}
    return dict(lifted(tuple(refused.items()))) if options.lean else refused


def _chosen(layer: Layer, measured: dict[str, Measured], runtime: str, batch_max: int,
            kept: dict[str, Measured] | None = None) -> Layer:
    """``layer`` with, per b, the runtime its ``time``/``ws`` are of: ``runtime`` wherever it
    measured the unit (a named one), else the fastest; torch on a tie (the one rule). Its
    ``runtimes`` are ``kept`` (default ``measured``): a runtime refused for its layout keeps
    its figures beside the refusal."""
    kept = measured if kept is None else kept
    chosen = []
    for b in range(1, batch_max + 1):
        if runtime not in ("auto", runtimes.TORCH) and runtime in measured:
            chosen.append(runtime)
        else:  # the fastest; torch on a tie
            chosen.append(min(measured, key=lambda rt: (measured[rt].time[b - 1],
                                                        rt != runtimes.TORCH)))
    return dataclasses.replace(
        layer, time=tuple(measured[rt].time[b - 1] for b, rt in enumerate(chosen, start=1)),
        ws=tuple(measured[rt].ws[b - 1] for b, rt in enumerate(chosen, start=1)),
        runtimes=tuple((rt, kept[rt]) for rt in runtimes.RUNTIMES if rt in kept),
        runtime=tuple(chosen))


def chosen_again(profile: Profile, capture: Capture, options: ProfileOptions) -> Profile:
    """``profile`` as ``options`` (another ``runtime`` of the same runtimes measured) would
    have chosen from the same measurements, under the fingerprint of ``options``: the table of
    ``--runtime onnxruntime`` from an ``auto`` profile, without measuring again."""
    measured_by = set(profile.meta.get("runtimes") or ()) | {runtimes.TORCH}
    if set(options.runtimes_on(capture.model.device)) - measured_by:
        raise UsageError(f"profile {profile.fingerprint} did not measure every runtime of "
                         f"--runtime {options.runtime}")

    def refusals(node: Layer | Parallel) -> tuple[tuple[str, str], ...]:
        return lifted(node.unsupported) if options.lean else node.unsupported

    def again(node: Node) -> Node:
        if isinstance(node, Layer):
            if not node.runtimes:
                return node
            kept = dict(node.runtimes)
            unsupported = dict(refusals(node))
            measured = {rt: m for rt, m in kept.items() if rt not in unsupported}
            return dataclasses.replace(_chosen(node, measured, options.runtime,
                                               profile.batch_max, kept),
                                       unsupported=tuple(unsupported.items()))
        if isinstance(node, Series):
            return dataclasses.replace(node, children=tuple(again(c) for c in node.children))
        return dataclasses.replace(node, branches=tuple(again(b) for b in node.branches),
                                   unsupported=refusals(node))

    lean = {"lean": True} if options.lean else {}  # tables of the worker without torch
    meta = {**profile.meta, **lean, "runtime": options.runtime,
            "fingerprint": fingerprint(capture, options), "chosen_from": profile.fingerprint}
    return Profile(profile.batch_max, again(profile.root), meta)  # type: ignore[arg-type]


def _fill(node: Node, options: ProfileOptions, figures: dict[str, _Figures],
          unsupported: dict[str, dict[str, str]]) -> Node:
    if isinstance(node, Layer):
        return _choose(node, options, figures, unsupported)
    if isinstance(node, Series):
        return dataclasses.replace(node, children=tuple(
            _fill(c, options, figures, unsupported) for c in node.children))
    B = options.batch_max
    folds = {rt: tuple(fill_time(f.times[node.name], B)) for rt, f in figures.items()}
    refused = _refused(node.name, unsupported, options)
    extra = [rt for rt in folds if rt != runtimes.TORCH and
             (rt not in refused or for_layout(refused[rt]))]
    return dataclasses.replace(
        node, time=folds[runtimes.TORCH],
        branches=tuple(_fill(b, options, figures, unsupported) for b in node.branches),
        runtimes=tuple((rt, Measured(folds[rt])) for rt in extra) if len(figures) > 1 else (),
        unsupported=tuple(refused.items()))


def _ort_figures(ort: Any, profiled: list[Any], figures: dict[str, _Figures],
                 run_samples: dict[int, list[list[float]]], grid: list[int], batch_max: int
                 ) -> dict[str, Any]:
    """ONNX Runtime's figures: each unit's and block's time inside its run (its kernels' share
    of what the run measured, replacing the single calls' times in ``figures``, which the fit
    of a call's cost reads first), the workspaces, and the meta: the call's cost per batch
    size, and the longest runs' measured seconds and what they hold inside."""
    from planner.profiling import ort as ort_profiling

    mine = figures[runtimes.ONNXRUNTIME]
    inside = ort_profiling.median_times(ort_profiling.kernel_times(profiled))
    io = {n.name: n.in_bytes + n.out_bytes for n in iter_layers(ort.units.capture.tree)}
    run_s = {b: [statistics.median(col[k] for col in run_samples[b]) for k in range(len(ort.runs))]
             for b in grid} if run_samples else {}
    fitted = ort_profiling.fit_call([
        (io[name] * b, mine.times[name][b] - inside[name][b]) for b in grid for name in io
        if name not in ort.unsupported and b in inside.get(name, {})])
    call = {b: fitted[0] for b in grid}
    per_byte = {b: fitted[1] for b in grid}
    for b in grid:
        # kernels are not the whole of a run (dispatch, waits between nodes): scale each run's
        # nodes so that, with its call's cost, the run costs what it measured
        for k, run in enumerate(ort.runs if run_s else ()):
            names = [n.name for node in run for n in iter_nodes(node)
                     if isinstance(n, (Layer, Parallel)) and n.name in inside]
            kernels = sum(inside[n][b] for n in names)
            cost = call[b] + per_byte[b] * b * (run[0].in_bytes + run[-1].out_bytes)
            if kernels > 0:
                scale = max(0.0, run_s[b][k] - cost) / kernels
                for n in names:
                    inside[n][b] *= scale
    for name, per in mine.times.items():  # inside a run where profiled in one, else alone
        mine.times[name] = inside.get(name) or {  # less a call (a block: nothing in or out)
            b: max(0.0, t - call[b] - per_byte[b] * io.get(name, 0) * b) for b, t in per.items()}
    units_ws, runs_ws = ort.workspaces(grid)
    mine.ws.update({name: fill_workspace(per, batch_max) for name, per in units_ws.items()})
    runs = [{"first": run[0].name, "last": run[-1].name,
             "seconds": fill_time({b: run_s[b][k] for b in grid}, batch_max),
             "ws": fill_workspace(runs_ws[k], batch_max)}
            for k, run in enumerate(ort.runs)] if run_s else []
    return {"version": runtimes.version(runtimes.ONNXRUNTIME),
            "call_s": fill_time(call, batch_max), "byte_s": fill_time(per_byte, batch_max),
            "runs": runs}


def measure(capture: Capture, options: ProfileOptions, progress: bool = True) -> Profile:
    """Measure every unit and join of ``capture`` at every batch size of the grid, on every
    runtime of ``options``.

    Units are measured where they run: in passes through the whole network at batch b (the
    reference runner), timing each unit and each fold in place, so every unit sees inputs
    fresh from the unit before it and weights as cold as in a real run (timed alone and
    repeated, a unit finds its weights in cache and looks faster than it is), and the
    regions add up to the whole pass (see PassTimer). Passes go round-robin over the batch
    sizes and the runtimes, so drift hits all of them alike.
    """
    started = time.perf_counter()
    grid = batch_grid(options.batch_max, options.grid)
    inputs = {b: capture.model.example(b, seed=b) for b in grid}
    rts = _Runtimes.of(capture, options, inputs, grid)
    layers = list(iter_layers(capture.tree))
    per_pass = len(layers)  # the bar counts unit runs: units x batch sizes x repeats
    passes = (options.warmup + options.repeats) * len(grid) * len(rts.runners)
    bar = tqdm(total=(passes + len(grid)) * per_pass, desc=f"profiling {capture.model.spec.name}",
               unit="unit", disable=not progress, leave=False)
    try:
        with torch.inference_mode():
            samples, run_samples = _timed_passes(capture, options, grid, inputs, rts,
                                                 lambda: bar.update(per_pass))
            peaks = _peaks(capture, grid, inputs, lambda: bar.update(per_pass))
    except torch.cuda.OutOfMemoryError as exc:  # = torch.OutOfMemoryError (torch >= 2.5)
        raise ProfileError(f"out of memory running batch {options.batch_max} on "
                           f"{capture.model.device}: profile with a smaller --batch-max") from exc
    finally:
        bar.close()
    figures = _torch_figures(capture, options, grid, samples, peaks)
    meta_runtimes = rts.meta(capture, figures, run_samples, grid, options.batch_max)
    if capture.model.device.type == "cuda":
        meta_runtimes.update(_cuda(capture, options, grid, inputs, figures, rts.unsupported))
    root = _fill(capture.tree, options, figures, rts.unsupported)
    assert isinstance(root, Series)
    meta = _meta(capture, options, grid, meta_runtimes, started)
    return Profile(batch_max=options.batch_max, root=root, meta=meta)


@dataclass
class _Runtimes:
    """The runtimes a profile measures: a runner per runtime (None: torch's own), ONNX
    Runtime's profiling state when it can run the model, and why units or it cannot."""

    runners: dict[str, UnitRunner | None]
    ort: Any = None  # planner.profiling.ort's prepared state
    profiled: list[Any] = field(default_factory=list)  # its sessions with its own profiler on
    unsupported: dict[str, dict[str, str]] = field(default_factory=dict)
    unavailable: str = ""

    @classmethod
    def of(cls, capture: Capture, options: ProfileOptions, inputs: dict[int, torch.Tensor],
           grid: list[int]) -> _Runtimes:
        rts = cls({runtimes.TORCH: None})
        if runtimes.ONNXRUNTIME not in options.runtimes_on(capture.model.device):
            return rts
        from planner.profiling import ort as ort_profiling  # onnx and onnxruntime: only here

        checks = [inputs[grid[0]], inputs[grid[min(2, len(grid) - 1)]]]
        prepared = ort_profiling.prepare(capture, checks)
        if isinstance(prepared, str):
            rts.unavailable = prepared
            return rts
        rts.ort = prepared
        # refused for their layout too (measured all the same: ``_choose`` keeps the figures)
        rts.unsupported[runtimes.ONNXRUNTIME] = {**prepared.layout, **prepared.unsupported}
        rts.runners[runtimes.ONNXRUNTIME] = prepared.runner()
        rts.profiled = prepared.profiled_sessions()
        return rts

    def meta(self, capture: Capture, figures: dict[str, _Figures],
             run_samples: dict[int, list[list[float]]], grid: list[int], batch_max: int
             ) -> dict[str, Any]:
        """``meta.runtimes``: each runtime's version, and ONNX Runtime's call costs and runs
        (its figures added to ``figures``), or why it is not used."""
        out: dict[str, Any] = {runtimes.TORCH: {"version": torch.__version__}}
        if self.ort is not None:
            try:
                out[runtimes.ONNXRUNTIME] = _ort_figures(self.ort, self.profiled, figures,
                                                         run_samples, grid, batch_max)
            except ProfileError as exc:  # its memory unknown, its plans could overrun: torch runs
                log.warning("%s: ONNX Runtime is not used: %s", capture.model.spec.name, exc)
                self.unavailable = str(exc)
                del figures[runtimes.ONNXRUNTIME]
                self.unsupported.pop(runtimes.ONNXRUNTIME, None)
        if self.unavailable:
            out[runtimes.ONNXRUNTIME] = {"unavailable": self.unavailable}
        return out


def _cuda(capture: Capture, options: ProfileOptions, grid: list[int],
          inputs: dict[int, torch.Tensor], figures: dict[str, _Figures],
          unsupported: dict[str, dict[str, str]]) -> dict[str, Any]:
    """On CUDA (``planner.profiling.cudagraph``): torch's time of every unit becomes the
    longer of the host's issue and the device's work, and CUDA graphs join the runtimes where
    asked for; their meta (or why they are not used)."""
    from planner.profiling import cudagraph

    wanted = runtimes.CUDAGRAPH in options.runtimes_on(capture.model.device)
    try:
        graphs = cudagraph.measure(capture, grid, inputs, options.repeats)
    except (VbsError, RuntimeError) as exc:  # torch's events in passes stand
        log.warning("%s: the device's time apart from the host's is not measured: %s",
                    capture.model.spec.name, exc)
        return {runtimes.CUDAGRAPH: {"unavailable": str(exc)}} if wanted else {}
    eager = figures[runtimes.TORCH].times
    for name, per in graphs.host.items():
        device = graphs.device.get(name, {}) if name not in graphs.unsupported else {}
        for b, host in per.items():
            if b in device:  # else the events' figure: the device time is not known apart
                eager[name][b] = max(host, device[b])
    if not wanted:
        return {}
    B = options.batch_max
    out = cudagraph.unsupported_for(capture, graphs)
    unsupported[runtimes.CUDAGRAPH] = out
    times = {name: dict(per) for name, per in graphs.inside.items() if name not in out}
    for name, per in eager.items():  # nodes graphs do not take: never read, but every node has one
        times.setdefault(name, dict(per))
    figures[runtimes.CUDAGRAPH] = _Figures(times, {
        n.name: fill_workspace(graphs.ws[n.name], B) for n in iter_layers(capture.tree)
        if n.name not in out})
    return {runtimes.CUDAGRAPH: {
        "version": runtimes.version(runtimes.CUDAGRAPH),
        "call_s": fill_time(graphs.call_s, B), "byte_s": fill_time(graphs.byte_s, B),
        "host_s": fill_time(graphs.host_s, B),
        "runs": [{"first": r["first"], "last": r["last"],
                  "seconds": fill_time(r["seconds"], B), "ws": fill_workspace(r["ws"], B)}
                 for r in graphs.runs],
        "eager_host_s": {name: fill_time(per, B) for name, per in graphs.host.items()},
    }}


# ONNX Runtime's runs are timed per pass as the mean of this many calls back to back, each on
# samples of its own into an output of its own, after one call not timed: as a plan's calls
# meet them (every unit's price inside a run is its share of that figure). One call per pass
# left the figure 9-12% (MAPE) off the same call timed a minute later; the median of three
# calls on the same input, each right after an identical one, 5-10% low at small batches
# against calls on samples of their own; a first call right after the pass's torch units and
# single-unit sessions up to 2x high (efficientnet_b1 at one sample), a state no plan meets
# (bench/price_state.py, docs/benchmarks.md section 3)
RUN_CALLS = 3


def _timed_passes(capture: Capture, options: ProfileOptions, grid: list[int],
                  inputs: dict[int, torch.Tensor], rts: _Runtimes, passed: Callable[[], Any]
                  ) -> tuple[dict[str, dict[str, dict[int, list[float]]]], dict[int, list[list[float]]]]:
    """Warm-up and timed passes, round-robin over batch sizes and runtimes: every region's
    seconds per runtime, name and batch size, and ONNX Runtime's runs' seconds per batch size."""
    timer = PassTimer(capture.model.device)
    samples: dict[str, dict[str, dict[int, list[float]]]] = {rt: {} for rt in rts.runners}
    run_samples: dict[int, list[list[float]]] = {}
    ort = rts.ort
    # samples of their own for each call of a run: one buffer, each batch size's calls slices
    # of it (a buffer per batch size would hold (RUN_CALLS + 1) * B * (B + 1) / 2 samples)
    fresh = capture.model.example((RUN_CALLS + 1) * max(grid), seed=0) \
        if ort is not None and ort.runs else None
    for k in range(options.warmup + options.repeats):
        counted = k >= options.warmup
        for b in grid:
            for rt, runner in rts.runners.items():
                timer.start()
                with MODULE_GATE.running():  # per pass: a trace elsewhere waits one pass
                    run_node(capture, capture.tree, inputs[b], timer, runner=runner)
                results = timer.results()
                if counted:
                    for name, seconds in results.items():
                        samples[rt].setdefault(name, {}).setdefault(b, []).append(seconds)
                passed()
            if fresh is not None:
                with MODULE_GATE.running():  # timed as a plan's calls meet them
                    pieces = fresh[:(RUN_CALLS + 1) * b].split(b)
                    ort.run_pass(pieces[-1])  # not timed: see RUN_CALLS
                    seconds = [statistics.fmean(col) for col in zip(
                        *(ort.run_pass(piece) for piece in pieces[:RUN_CALLS]))]
                    ort.run_pass(inputs[b], rts.profiled, counted=counted)
                if counted:
                    run_samples.setdefault(b, []).append(seconds)
    return samples, run_samples


def _peaks(capture: Capture, grid: list[int], inputs: dict[int, torch.Tensor],
           passed: Callable[[], Any]) -> dict[str, dict[int, int]]:
    """Every region's peak memory per batch size: CUDA's allocator statistics, or the torch
    profiler's memory events on the CPU."""
    peaks: dict[str, dict[int, int]] = {}
    if capture.model.device.type == "cuda":
        for b in grid:
            cuda = CudaPeaks(capture.model.device)
            with MODULE_GATE.running():
                run_node(capture, capture.tree, inputs[b], cuda)
            for name, peak in cuda.peaks.items():
                peaks.setdefault(name, {})[b] = peak
            passed()
        return peaks

    def body(region: Callable[[str], Any]) -> None:
        for b in grid:
            with MODULE_GATE.running():
                run_node(capture, capture.tree, inputs[b], lambda name: region(f"{name}|{b}"))
            passed()

    for label, peak in cpu_memory_regions(body).items():
        name, b = label.rsplit("|", 1)
        peaks.setdefault(name, {})[int(b)] = peak
    return peaks


def _torch_figures(capture: Capture, options: ProfileOptions, grid: list[int],
                   samples: dict[str, dict[str, dict[int, list[float]]]],
                   peaks: dict[str, dict[int, int]]) -> dict[str, _Figures]:
    """Median times per runtime, and torch's workspaces: what a unit needs at its peak beyond
    its own output (its input was held), the output counted as the allocator rounds it, as
    the executor's walk counts it."""
    blocks = [n for n in iter_nodes(capture.tree) if isinstance(n, Parallel)]
    figures: dict[str, _Figures] = {}
    for rt, per_name in samples.items():
        times = {name: {b: statistics.median(ts) for b, ts in per.items()}
                 for name, per in per_name.items()}
        for block in blocks:  # a block with only identity branches folds nothing timed
            times.setdefault(block.name, {b: 0.0 for b in grid})
        figures[rt] = _Figures(times, {})
    granule = granule_for(capture.model.device.type)
    figures[runtimes.TORCH].ws.update({
        n.name: fill_workspace({b: max(0, p - allocation(n.out_bytes * b, granule))
                                for b, p in peaks.get(n.name, {b: 0 for b in grid}).items()},
                               options.batch_max) for n in iter_layers(capture.tree)})
    return figures


def _meta(capture: Capture, options: ProfileOptions, grid: list[int],
          meta_runtimes: dict[str, Any], started: float) -> dict[str, Any]:
    """The profile's ``meta``: what was measured, how, on what, and its fingerprint."""
    device = capture.model.device
    spec = capture.model.spec
    precision = {"precision": capture.precision.to_json()} if capture.precision.chosen else {}
    lean = {"lean": True} if options.lean else {}  # tables of the worker without torch
    return {
        **precision, **lean,
        "model": spec.name, "input_shape": list(capture.input_shape), "dtype": spec.dtype,
        "device": device.type, "device_name": device_name(device), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "batch_sizes_measured": grid, "interpolated": options.grid, "repeats": options.repeats,
        "warmup": options.warmup, "threads": torch.get_num_threads(),
        "units": len(list(iter_layers(capture.tree))),
        "parallel_blocks": sum(isinstance(n, Parallel) for n in iter_nodes(capture.tree)),
        "alloc_granule": granule_for(device.type),
        "runtime": options.runtime, "runtimes": meta_runtimes,
        "fingerprint": fingerprint(capture, options),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - started, 2),
    }


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
            if capture.precision.chosen:  # the same kernels; what the guard measured is now's
                profile = dataclasses.replace(profile, meta={
                    **profile.meta, "precision": capture.precision.to_json()})
            return profile, True
    profile = measure(capture, options, progress=progress)
    try:
        save_profile(profile, path)
    except OSError as exc:
        log.warning("could not cache the profile at %s: %s", path, exc)
    return profile, False
