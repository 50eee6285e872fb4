"""Profiling on CUDA: the device's time, the host's apart, and CUDA graphs' runs.

Timed in passes that the host paces (one CUDA event after every unit), a small batch
measures the host launching kernels and recording events, not the device. So on CUDA:

- **the device's time** of every unit at every batch size is its CUDA graph's (the unit
  alone, captured at that batch) replayed back to back between two events: the device kept
  busy, no launch in between; a block's fold is its whole graph's time less its units';
- **the host's time** of an eager step is what issuing its kernels takes (``perf_counter``
  around the unit's call after a synchronise, so no full launch queue slows it): an eager
  step costs the longer of the two (one stream waits for the slower), and that is torch's
  figure on CUDA;
- **a graph's call** (copy in, replay, copy out) is timed back to back too, unit by unit:
  over the unit's own time it costs ``call_s + byte_s * bytes`` (``planner.profiling.fit``),
  and the host's issue of one (``host_s``) is timed apart;
- **runs as the executor runs them**: the longest runs graphs take (usually the whole
  model) are captured and called back to back; each unit's time inside a run is its share
  of that, scaled so that the run's units and its call add up to what the run measured;
- **memory**: what a graph's capture allocates in its pool beyond its input (its
  intermediates and its output before the copy) is a unit's, or a run's, workspace on this
  runtime: the worker keeps the pool, and plans count it as ONNX Runtime's (``core.runs``).

A unit is the graphs' where it captures and its graph's output equals eager torch's within
the dtype's tolerance. Everything here needs CUDA; a model that cannot be captured at all
leaves graphs out of the profile with the reason, and torch's figures stand.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.errors import ExecutionError, OutOfMemoryError, ProfileError
from core.runner import run_node, run_unit
from core.runtimes import CUDAGRAPH
from core.runtimes.cudagraph import GraphUnits, unavailable
from core.tree import Layer, Node, Parallel, Series, iter_nodes
from core.units import MODULE_GATE, Capture
from planner.profiling.fit import fit_call
from planner.profiling.measure import differs
from planner.profiling.takes import closed, longest_runs

log = logging.getLogger("vbs.profile")

REPLAYS = 10  # replays back to back per timing: the device kept busy


@dataclass
class GraphFigures:
    """What the profile takes from CUDA: per (node, b) the device's time alone, the host's
    time of an eager step, a graph's time inside the longest runs and its pool workspace,
    and the call's cost per b."""

    device: dict[str, dict[int, float]] = field(default_factory=dict)  # unit or block, alone
    host: dict[str, dict[int, float]] = field(default_factory=dict)    # eager unit, issue
    inside: dict[str, dict[int, float]] = field(default_factory=dict)  # graph, inside a run
    ws: dict[str, dict[int, int]] = field(default_factory=dict)        # graph's pool, per unit
    call_s: dict[int, float] = field(default_factory=dict)
    byte_s: dict[int, float] = field(default_factory=dict)
    host_s: dict[int, float] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)  # first, last, seconds {b}, ws {b}
    unsupported: dict[str, str] = field(default_factory=dict)


def _replays(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds of one ``fn()`` on the device, ``REPLAYS`` back to back between two events,
    the median of ``repeats`` such timings."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / REPLAYS)
    return statistics.median(out)


def _host(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds the host spends issuing ``fn()`` (the device idle before each)."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    return statistics.median(out)


def _inputs(capture: Capture, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every unit's and block's input in a real pass on ``x`` (and what torch gives for it)."""
    seen: dict[str, torch.Tensor] = {}

    def visit(node: Node, x: torch.Tensor) -> torch.Tensor:
        if isinstance(node, Series):
            for child in node.children:
                x = visit(child, x)
            return x
        seen[node.name] = x
        if isinstance(node, Layer):
            return run_unit(capture, node, x)
        for branch in node.branches:
            visit(branch, x)
        return run_node(capture, node, x)

    visit(capture.tree, x)
    return seen


def measure(capture: Capture, grid: list[int], inputs: dict[int, torch.Tensor],
            repeats: int) -> GraphFigures:
    """Every figure of the module's doc, batch size by batch size (one pool each, given back
    before the next)."""
    why = unavailable(capture)
    if why:
        raise ProfileError(why)
    figures = GraphFigures()
    points: list[tuple[float, float]] = []  # (io bytes, alone - inside) for the call's fit
    with torch.inference_mode(), MODULE_GATE.running():
        for b in grid:
            units = GraphUnits(capture)
            try:
                _measure_batch(capture, units, b, inputs[b], repeats, figures, points)
            finally:
                units.release()
    _folds(capture, figures)
    call, per_byte = fit_call(points)
    for b in grid:
        figures.call_s[b], figures.byte_s[b] = call, per_byte
    _runs_and_shares(capture, grid, inputs, repeats, figures)
    return figures


def _measure_batch(capture: Capture, units: GraphUnits, b: int, x: torch.Tensor,
                   repeats: int, figures: GraphFigures, points: list[tuple[float, float]]
                   ) -> None:
    """At b samples: every unit's eager issue, its graph alone (replays, calls, pool), and
    every block's graph whole, on the activations a real pass gives them."""
    device = capture.model.device
    seen = _inputs(capture, x)
    hosts = []
    for node in iter_nodes(capture.tree):
        if not isinstance(node, (Layer, Parallel)):
            continue
        xin = seen[node.name]
        if isinstance(node, Layer):
            figures.host.setdefault(node.name, {})[b] = _host(
                lambda: run_unit(capture, node, xin), device, repeats)
        if node.name in figures.unsupported:
            continue
        try:
            graph = units.captured((node,), b)
        except (ExecutionError, OutOfMemoryError) as exc:
            figures.unsupported[node.name] = str(exc)
            continue
        graph.x.copy_(xin)
        graph.graph.replay()
        want = run_node(capture, node, xin)
        why = differs(graph.y, want)
        if why:
            figures.unsupported[node.name] = f"its graph's {why[4:]}"
            continue
        figures.device.setdefault(node.name, {})[b] = _replays(graph.graph.replay, device,
                                                               repeats)
        figures.ws.setdefault(node.name, {})[b] = graph.inner
        if isinstance(node, Layer):
            alone = _replays(lambda: units.call((node,), xin, b), device, repeats)
            points.append((float((node.in_bytes + node.out_bytes) * b),
                           alone - figures.device[node.name][b]))
            hosts.append(_host(lambda: units.call((node,), xin, b), device, repeats))
    figures.host_s[b] = statistics.median(hosts) if hosts else 0.0


def _runs_and_shares(capture: Capture, grid: list[int], inputs: dict[int, torch.Tensor],
                     repeats: int, figures: GraphFigures) -> None:
    """The longest runs called back to back, as the executor calls them, and every unit's
    time inside a run: its share of what its run measured (a unit in no run: alone)."""
    runs = longest_runs(capture.tree, unsupported_for(capture, figures))
    device = capture.model.device
    for b in grid:
        units = GraphUnits(capture)
        try:
            with torch.inference_mode(), MODULE_GATE.running():
                seen = _inputs(capture, inputs[b])
                for run in runs:
                    xin = seen[run[0].name]
                    try:
                        graph = units.captured(run, b)
                    except (ExecutionError, OutOfMemoryError) as exc:  # its units: alone
                        log.warning("%s: the run %s..%s on %d samples is not measured whole: "
                                    "%s", capture.model.spec.name, run[0].name, run[-1].name,
                                    b, exc)
                        continue
                    seconds = _replays(lambda: units.call(run, xin, b), device, repeats)
                    _record_run(figures, run, b, seconds, graph.inner)
        finally:
            units.release()
    # a run measured whole at every batch size is one the walk counts as measured
    figures.runs = [r for r in figures.runs if set(r["seconds"]) == set(grid)]
    for name, per in figures.device.items():  # alone where no run scaled it
        inside = figures.inside.setdefault(name, {})
        for b, t in per.items():
            inside.setdefault(b, t)


def _record_run(figures: GraphFigures, run: tuple[Node, ...], b: int, seconds: float,
                inner: int) -> None:
    """A run's measured seconds and pool at b; its units' shares of the seconds."""
    record = next((r for r in figures.runs if r["first"] == run[0].name
                   and r["last"] == run[-1].name), None)
    if record is None:
        record = {"first": run[0].name, "last": run[-1].name, "seconds": {}, "ws": {}}
        figures.runs.append(record)
    record["seconds"][b], record["ws"][b] = seconds, inner
    names = [n.name for node in run for n in iter_nodes(node) if isinstance(n, (Layer, Parallel))]
    alone = sum(figures.device[n][b] for n in names)
    call = figures.call_s[b] + figures.byte_s[b] * b * (run[0].in_bytes + run[-1].out_bytes)  # type: ignore[union-attr]
    scale = max(0.0, seconds - call) / alone if alone > 0 else 0.0
    for n in names:
        figures.inside.setdefault(n, {})[b] = figures.device[n][b] * scale


def _folds(capture: Capture, figures: GraphFigures) -> None:
    """A block's device time is its fold: its whole graph's time less its units' (each
    alone), computed before any run is scaled by them; inner blocks first."""
    for block in reversed(list(iter_nodes(capture.tree))):
        per = figures.device.get(block.name) if isinstance(block, Parallel) else None
        if not per:
            continue
        names = [n.name for n in iter_nodes(block) if n is not block
                 and isinstance(n, (Layer, Parallel))]
        for b in list(per):
            per[b] = max(0.0, per[b] - sum(figures.device.get(n, {}).get(b, 0.0) for n in names))


def unsupported_for(capture: Capture, figures: GraphFigures) -> dict[str, str]:
    """Why graphs cannot take each node they do not (a block: one inside it they do not)."""
    return closed(capture.tree, figures.unsupported, "it holds {}, which graphs do not take")


__all__ = ["CUDAGRAPH", "GraphFigures", "measure", "unsupported_for"]
