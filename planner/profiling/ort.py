"""Profiling ONNX Runtime beside torch: which units it takes, and what they cost in a run.

A unit is ONNX Runtime's when its graph exported and its outputs equal torch's on real
activations (at two batch sizes); an int8 unit's (``core.precision``) when its output has
torch's shape, its values bounded by the guard on calibration samples (``planner.precision``). Beside torch, only where its input and output are dense
there too: ONNX Runtime binds dense tensors only, so a channels-last input would need a copy
before each call, and a dense output where the model has a channels-last one would give
torch's next unit another layout than profiled (other kernels, other workspaces): memory the
executor's walk does not count. Such a unit is measured all the same and refused for its
``LAYOUT`` alone, which the tables of the worker without torch lift (every step there is
ONNX Runtime's, on dense arrays). A block, when its whole run does too.

What a unit costs depends on the run it is in: ONNX Runtime fuses across units, keeps its
blocked layout between them, and binds and dispatches once per call. So a unit's time is its
share of the longest run the model allows: its kernels' time in ONNX Runtime's own profiler
(every node is named after its unit), scaled so that the run's units and its call add up to
what the run measured. A call costs, beyond its units, ``call_s + byte_s * (bytes in + bytes
out)``: the fixed cost and the reordering of its input and output, which is what cutting a
run costs the plans that cut it. Those two are fitted once (least squares, both >= 0) to what
every unit costs called alone over its time inside the run, at every batch size
(``fit_call``). A run of one unit then costs what it measured alone, and the whole network
what it measured as one call, both within the fit.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnxruntime
import torch

from core.precision import INT8
from core.units import MODULE_GATE, Capture
from core.runner import UnitRunner, run_node, run_unit
from core.runtimes.onnx_graphs import UnitGraphs
from core.runtimes.onnxrt import OrtUnits, providers, session_options, unavailable
from core.runtimes.ort_memory import measure_workspaces
from core.tree import Layer, Node, Parallel, Series, iter_layers, iter_nodes
from planner.profiling.fit import fit_call
from planner.profiling.measure import differs
from planner.profiling.takes import LAYOUT, closed, longest_runs

__all__ = ["LAYOUT", "OrtProfile", "fit_call", "kernel_times", "median_times", "prepare"]

@dataclass
class _Profiled:
    """A session of one run with ONNX Runtime's profiler on: node times per call."""

    session: onnxruntime.InferenceSession
    owner: dict[str, str]  # node-name prefix -> unit or block name
    directory: str  # its own: ONNX Runtime names the file by the millisecond it started
    calls: list[tuple[int, bool]] = field(default_factory=list)  # (batch size, counted) per call


@dataclass(frozen=True)
class OrtProfile:
    """ONNX Runtime's units for one capture and what it cannot take (node name -> why)."""

    units: OrtUnits
    unsupported: dict[str, str]
    runs: tuple[tuple[Node, ...], ...]  # the longest runs of the root series it can take
    # units (and blocks holding one) whose input or output is not dense in the model: measured
    # here, and taken only where nothing runs on torch (``LAYOUT``)
    layout: dict[str, str] = field(default_factory=dict)

    def supports(self, node: Node) -> bool:
        if node.name in self.unsupported:
            return False
        if isinstance(node, Layer):
            return True
        children = node.children if isinstance(node, Series) else \
            tuple(c for b in node.branches for c in b.children)  # type: ignore[union-attr]
        return all(self.supports(c) for c in children)

    def runner(self) -> UnitRunner:
        """Runs each unit as one ONNX Runtime call (torch where it cannot)."""
        capture, units = self.units.capture, self.units

        def run(unit: Layer, x: torch.Tensor, own: bool) -> torch.Tensor:
            if unit.name in self.unsupported:
                return run_unit(capture, unit, x, in_place=own)
            out = units.output(unit, x, x.shape[0])
            return units.run(unit.name, unit.name, x.contiguous(), out)

        return run

    def run_pass(self, x: torch.Tensor, profiled: list[_Profiled] | None = None,
                 counted: bool = True) -> list[float]:
        """One pass through the root series, each run of ``runs`` as one call (in its
        profiled session when ``profiled`` is given, the call ``counted`` or not), the rest
        on torch; each run's seconds."""
        capture = self.units.capture
        seconds = []
        position = 0
        children = capture.tree.children
        for k, run in enumerate(self.runs):
            start = children.index(run[0])
            for node in children[position:start]:
                x = run_node(capture, node, x)
            out = self.units.output(run[-1], x, x.shape[0])
            x = x.contiguous()
            if profiled is None:
                t0 = time.perf_counter()
                x = self.units.run(run[0].name, run[-1].name, x, out)
                seconds.append(time.perf_counter() - t0)
            else:
                profiled[k].calls.append((int(x.shape[0]), counted))
                x = torch.from_numpy(profiled[k].session.run(None, {"x": x.numpy()})[0])
            position = start + len(run)
        return seconds

    def profiled_sessions(self) -> list[_Profiled]:
        """A session with ONNX Runtime's profiler on for each run of ``runs``, each writing in a
        directory of its own (two sessions started in the same millisecond would share a file
        name, and the first to end would take the other's file away)."""
        out = []
        for run in self.runs:
            options = session_options(self.units.threads)
            options.enable_profiling = True
            directory = tempfile.mkdtemp(prefix="vbs-ort-profile-")
            options.profile_file_prefix = f"{directory}/run"
            try:
                session = onnxruntime.InferenceSession(
                    self.units.graphs.compose(run).SerializeToString(), options,
                    providers=providers(self.units.device))
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            owner = {n.name: n.name for node in run for n in iter_nodes(node)
                     if isinstance(n, (Layer, Parallel))}
            out.append(_Profiled(session, owner, directory))
        return out

    def workspaces(self, batches: list[int]) -> tuple[dict[str, dict[int, int]],
                                                       list[dict[int, int]]]:
        """Every supported unit's workspace at every batch size, and what each run of
        ``runs`` holds inside, measured in a child process."""
        graphs, capture = self.units.graphs, self.units.capture
        jobs = [(layer.name, graphs.compose([layer]).SerializeToString(),
                 graphs.input_shape(layer.name), capture.units[layer.name].out_shape)
                for layer in iter_layers(capture.tree) if layer.name not in self.unsupported]
        for k, run in enumerate(self.runs):
            first = next(iter_layers(run[0]))
            last = run[-1]
            out = (capture.joins[last.name].out_shape if isinstance(last, Parallel)
                   else capture.units[last.name].out_shape)
            jobs.append((f"\0run{k}", graphs.compose(run).SerializeToString(),
                         graphs.input_shape(first.name), out))
        measured = measure_workspaces(jobs, batches, dtype="float32",
                                      threads=torch.get_num_threads())
        runs = [measured.pop(f"\0run{k}") for k in range(len(self.runs))]
        return measured, runs


def kernel_times(profiled: Sequence[_Profiled]) -> dict[str, dict[int, list[float]]]:
    """Seconds of each unit's and block's kernels per call of the profiled sessions, by name
    and batch size (ends their profiling). A node of ONNX Runtime's own that no unit names
    (a layout reorder) counts for its neighbour: the unit after it for an input reorder, the
    unit before it otherwise."""
    out: dict[str, dict[int, list[float]]] = {}
    for p in profiled:
        path = p.session.end_profiling()
        try:
            with open(path) as f:
                events = json.load(f)
        finally:
            shutil.rmtree(p.directory, ignore_errors=True)
        calls = iter(p.calls)
        times: dict[str, float] = {}
        pending = 0.0
        previous = ""
        for event in events:
            name = str(event.get("name", ""))
            if event.get("cat") == "Session" and name == "model_run":
                b, counted = next(calls)
                for owner in (p.owner.values() if counted else ()):
                    out.setdefault(owner, {}).setdefault(b, []).append(times.get(owner, 0.0))
                times, pending, previous = {}, 0.0, ""
                continue
            if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
                continue
            seconds = float(event.get("dur", 0)) / 1e6
            owner = p.owner.get(name.split("/", 1)[0], "")
            if not owner:
                if name.startswith("ReorderInput") or not previous:
                    pending += seconds
                else:
                    times[previous] += seconds
                continue
            times[owner] = times.get(owner, 0.0) + seconds + pending
            pending, previous = 0.0, owner
    return out


def median_times(samples: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, float]]:
    return {name: {b: statistics.median(ts) for b, ts in per.items()}
            for name, per in samples.items()}


def prepare(capture: Capture, checks: list[torch.Tensor]) -> OrtProfile | str:
    """ONNX Runtime's units of ``capture``, checked against torch on each input of
    ``checks``; or why it cannot run the model here."""
    why = unavailable(capture)
    if why:
        return why
    units = OrtUnits(capture)
    graphs = units.graphs
    unsupported = dict(graphs.failed)
    layout: dict[str, str] = {}
    with torch.inference_mode(), MODULE_GATE.running():
        for x in checks:
            _check(capture, units, graphs, x, unsupported, layout)
    # a block runs whole only if all it holds can
    unsupported = closed(capture.tree, unsupported, "it holds {}, which runs on torch")
    layout = {name: why for name, why in closed(
        capture.tree, layout, LAYOUT + "it holds {}, whose layout is not dense").items()
        if name not in unsupported}
    return OrtProfile(units, unsupported, longest_runs(capture.tree, unsupported), layout)


def _check(capture: Capture, units: OrtUnits, graphs: UnitGraphs, x: torch.Tensor,
           unsupported: dict[str, str], layout: dict[str, str]) -> torch.Tensor:
    """Torch's output of the tree on ``x``; every unit and block ONNX Runtime differs on
    (beyond tolerance) is added to ``unsupported``, every one whose input or output is not
    dense in the model to ``layout`` (its values checked all the same)."""

    def compare(node: Node, x: torch.Tensor, want: torch.Tensor) -> None:
        got = units.run(node.name, node.name, x.contiguous(), units.output(node, x, x.shape[0]))
        # int8 units answer as the guard measured on calibration samples (``core.precision``),
        # not as torch does: their shape is checked here, their values were there
        int8 = any(capture.precision.of(n.name) == INT8 for n in iter_nodes(node))
        why = differs(got, want, values=not int8)
        if why:
            unsupported[node.name] = why

    def dense(node: Node, x: torch.Tensor, want: torch.Tensor) -> bool:
        for what, t in (("input", x), ("output", want)):
            if not t.is_contiguous() and node.name not in layout:
                layout[node.name] = (
                    f"{LAYOUT}its {what} is not dense in the model (strides "
                    f"{tuple(t.stride())}: channels-last or a view); ONNX Runtime takes and "
                    "gives dense tensors only, and beside torch a copy, or torch's next unit "
                    "meeting another layout than profiled, would be memory the plan does not "
                    "count (where every step is ONNX Runtime's, as in the worker without "
                    "torch, it is taken)")
        return node.name not in unsupported

    def visit(node: Node, x: torch.Tensor) -> torch.Tensor:
        if isinstance(node, Layer):
            want = run_unit(capture, node, x)
            if dense(node, x, want):
                compare(node, x, want)
            return want
        if isinstance(node, Series):
            for child in node.children:
                x = visit(child, x)
            return x
        for branch in node.branches:
            visit(branch, x)
        want = run_node(capture, node, x)
        inside_ok = all(n.name not in unsupported for n in iter_nodes(node))
        if dense(node, x, want) and inside_ok and not graphs.reason(node):
            compare(node, x, want)
        return want

    return visit(capture.tree, x)
