"""An interim table: what a model is served with before its tables exist, built in seconds.

Why: profiling every unit at every batch size and solving takes minutes on a small CPU
(docs/benchmarks.md, section 12). A model the store has no table for is served at once with this table while `vbs plan` profiles and solves beside it
(``service.first_start``); the planned table replaces it when it is published, swapped in
between batches as any table published to the store (``service.table_watch``).

What it holds: the whole model as one ONNX Runtime call (the root series' children, one run)
at the batch sizes of ``batch_sizes`` (powers of two up to B, and B). For every request size
r = 1..B and every such batch c <= r, a plan runs r samples in calls of c while c are left,
the rest in powers of two, largest first (``phases``): every call is at a batch size that
was measured. Each row keeps, by ascending memory, every plan faster than all that need less
(fbs-best's rule over these plans).

Measured, never guessed: what ONNX Runtime holds inside one call of the whole model at each
of those batch sizes, in a child process (``core.runtimes.ort_memory``: the profiler's
measurement of a run, with its margin), and the call's seconds here (the median of
``REPEATS`` after one untimed call). A plan's peak is the executor's walk over its steps with
those measurements (``core.walk.layout``, as for every table), so the claim holds as it does
for a planned table: a plan picked for F bytes never allocates more than F, and the worker's
lookups, leases and splits work unchanged. Its outputs are ONNX Runtime's run of the whole
model, checked against torch here before the table is used (the profiler's tolerance).

Where ONNX Runtime cannot run the whole model here (not the CPU, not float32, a unit that
did not export, a graph that cannot be composed, outputs that differ from torch's) there is
no interim table: ``build`` says why, and the model is planned before it serves, as before.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from core import runtimes as rt
from core.errors import ProfileError, VbsError
from core.gate import MODULE_GATE
from core.program import Step, program_id
from core.runner import run_node
from core.runtimes.base import RuntimeOptions
from core.runtimes.onnx_compose import CannotCompose
from core.runtimes.onnxrt import OrtUnits, load as load_ort, unavailable
from core.runtimes.ort_memory import measure_workspaces
from core.sizes import granule_for
from core.table import INTERIM, PlanTable, TablePlan, TableRow
from core.tree import Node, Parallel, Profile, Series, iter_layers
from core.units import Capture
from core.walk import Layout, layout

log = logging.getLogger("vbs.plan")

REPEATS = 3          # timed calls of the whole model per batch size, after one untimed
CHECK_SAMPLES = 2    # samples its outputs are checked against torch's on


@dataclass(frozen=True)
class Interim:
    """An interim table, the ONNX Runtime units it was measured on (their session of the whole
    model made: a worker serves with them), the tree unmeasured (for the page) and what was
    measured: each batch size's seconds and bytes held inside the call."""

    table: PlanTable
    units: OrtUnits
    profile: Profile
    seconds: dict[int, float]
    held: dict[int, int]
    build_s: float


def batch_sizes(batch_max: int) -> tuple[int, ...]:
    """The batch sizes measured: every power of two below ``batch_max``, and ``batch_max``."""
    sizes = []
    b = 1
    while b < batch_max:
        sizes.append(b)
        b *= 2
    return (*sizes, batch_max)


def phases(r: int, c: int) -> list[int]:
    """The calls of a plan of r samples at batch c: c while c are left, then the rest in
    powers of two, largest first (each one of ``batch_sizes``)."""
    out = [c] * (r // c)
    rest = r % c
    while rest:
        b = 1 << (rest.bit_length() - 1)
        out.append(b)
        rest -= b
    return out


def build(capture: Capture, fingerprint: str, batch_max: int, options: RuntimeOptions
          ) -> Interim | str:
    """The interim table of ``capture`` for request sizes 1..``batch_max``, under the
    fingerprint its planned tables will have; or why ONNX Runtime cannot serve the whole model
    here (then there is none, and nothing it made is kept)."""
    started = time.perf_counter()
    why = unavailable(capture)
    if why:
        return f"ONNX Runtime cannot run it here: {why}"
    units = load_ort(capture, options)
    try:
        built = _measured(capture, fingerprint, batch_max, units)
    except VbsError as exc:  # a session it could not make (memory), a measurement that failed
        built = str(exc)
    except BaseException:
        units.release()
        raise
    if isinstance(built, str):
        units.release()  # its sessions given back: the model is planned first instead
        return built
    table, seconds, held = built
    profile = Profile(batch_max, capture.tree, {
        "fingerprint": fingerprint, "model": capture.model.spec.name, INTERIM: True,
        "input_shape": list(capture.input_shape), "dtype": capture.model.spec.dtype,
        "device": capture.model.device.type})
    return Interim(table, units, profile, seconds, held, time.perf_counter() - started)


def _measured(capture: Capture, fingerprint: str, batch_max: int, units: OrtUnits
              ) -> tuple[PlanTable, dict[int, float], dict[int, int]] | str:
    """The whole model checked, measured (memory in a child process, then time) and its
    table; or why it cannot be."""
    nodes = capture.tree.children
    try:
        graph = units.graphs.compose(nodes).SerializeToString()
    except CannotCompose as exc:
        return f"its whole graph cannot run in ONNX Runtime ({exc})"
    why = _check(capture, units)
    if why:
        return f"ONNX Runtime's run of the whole model is not torch's: {why}"
    sizes = batch_sizes(batch_max)
    held = measure_workspaces([("model", graph,
                                units.graphs.input_shape(next(iter_layers(nodes[0])).name),
                                _out_shape(capture, nodes[-1]))], list(sizes), dtype="float32",
                              threads=units.threads)["model"]
    seconds = _time(capture, units, sizes)
    table = table_of(capture.tree, capture.uniform_order, fingerprint, batch_max, seconds, held,
                     granule_for(capture.model.device.type))
    return table, seconds, held


def _out_shape(capture: Capture, node: Node) -> tuple[int, ...]:
    """Per-sample output shape of a child of the root series (a unit, or a block's join)."""
    if isinstance(node, Parallel):
        return tuple(capture.joins[node.name].out_shape)
    return tuple(capture.units[node.name].out_shape)


def _check(capture: Capture, units: OrtUnits) -> str:
    """Why ONNX Runtime's run of the whole model differs from torch's on a seeded input ('' if
    it does not)."""
    from planner.profiling.measure import differs

    nodes = capture.tree.children
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((CHECK_SAMPLES, *capture.input_shape), generator=generator)
    with torch.inference_mode(), MODULE_GATE.running():
        want = run_node(capture, capture.tree, x.clone())
        got = units.run(nodes[0].name, nodes[-1].name, x,
                        units.output(nodes[-1], x, CHECK_SAMPLES))
    return differs(got, want)


def _time(capture: Capture, units: OrtUnits, sizes: tuple[int, ...]) -> dict[int, float]:
    """Seconds of one call of the whole model at each batch size: the median of ``REPEATS``
    after one untimed call (which makes its session)."""
    nodes = capture.tree.children
    out: dict[int, float] = {}
    for b in sizes:
        x = torch.randn((b, *capture.input_shape))
        y = units.output(nodes[-1], x, b)
        times = []
        for k in range(REPEATS + 1):
            t0 = time.perf_counter()
            units.run(nodes[0].name, nodes[-1].name, x, y)
            if k:
                times.append(time.perf_counter() - t0)
        out[b] = statistics.median(times)
    return out


def table_of(root: Series, order: tuple[str, ...], fingerprint: str, batch_max: int,
             seconds: dict[int, float], held: dict[int, int], granule: int = 1) -> PlanTable:
    """The interim table from what was measured (``seconds``, ``held``: by batch size, every
    size of ``batch_sizes``); ``order``: every unit and block of ``root`` in the order a
    uniform program runs them (``Capture.uniform_order``)."""
    sizes = batch_sizes(batch_max)
    missing = [b for b in sizes if b not in seconds or b not in held]
    if missing:
        raise ProfileError(f"the interim table needs the whole model measured at batch sizes "
                           f"{missing} too")
    # what a call holds, per batch size 1..B: only the sizes of ``sizes`` are ever read
    # (every call of every plan is at one of them); the others carry the next one up's figure
    inside = tuple(held[min(s for s in sizes if s >= b)] for b in range(1, batch_max + 1))
    measured = {(root.children[0].name, root.children[-1].name): inside}
    index = {name: i for i, name in enumerate(order)}
    plans: list[TablePlan] = []
    by_id: dict[str, int] = {}
    rows = []
    for r in range(1, batch_max + 1):
        laid = []
        for c in (s for s in sizes if s <= r):
            steps, runs = _program(order, phases(r, c))
            lay = layout(root, steps, r, granule=granule, runs=runs, measured=measured)
            laid.append((lay, sum(seconds[p] for p in phases(r, c)), steps, runs))
        peaks, chosen = [], []
        best = np.inf
        for lay, secs, steps, runs in sorted(laid, key=lambda t: (t[0].peak, t[1])):
            if secs >= best or (peaks and peaks[-1] == lay.peak):
                continue  # as fast as a plan that needs less (or as much): never chosen
            best = secs
            plan = _plan(index, steps, runs, lay, secs)
            if plan.plan_id not in by_id:
                by_id[plan.plan_id] = len(plans)
                plans.append(plan)
            peaks.append(lay.peak)
            chosen.append(by_id[plan.plan_id])
        rows.append(TableRow(np.array(peaks, dtype=np.int64), np.array(chosen, dtype=np.int64)))
    return PlanTable(fingerprint=fingerprint, solver=INTERIM, objective="time", slot_bytes=1,
                     granule=granule, batch_max=batch_max, units=order, plans=tuple(plans),
                     rows=tuple(rows), runtimes=(rt.ONNXRUNTIME,))


def _program(order: tuple[str, ...], calls: list[int]
             ) -> tuple[tuple[Step, ...], tuple[tuple[int, int], ...]]:
    """Every unit and block once per call, on that call's samples, each call one run."""
    steps: list[Step] = []
    runs = []
    for p in calls:
        start = len(steps)
        steps.extend(Step(name, p, rt.ONNXRUNTIME) for name in order)
        runs.append((start, len(steps) - 1))
    return tuple(steps), tuple(runs)


def _plan(index: dict[str, int], steps: tuple[Step, ...], runs: tuple[tuple[int, int], ...],
          lay: Layout, seconds: float) -> TablePlan:
    """A table's plan of ``steps`` as laid out (its peak: the executor's walk's)."""
    units = np.array([index[s.unit] for s in steps], dtype=np.int32)
    samples = np.array([s.samples for s in steps], dtype=np.int32)
    unit_peaks = np.zeros(len(index), dtype=np.int64)
    np.maximum.at(unit_peaks, units, np.asarray(lay.needs, dtype=np.int64))
    plan_id = program_id(((s.unit, s.samples, s.runtime) for s in steps), runs)
    # no DP priced or modelled it: its cost is its measured time, its model its walk
    return TablePlan(plan_id, units, samples, seconds, seconds, lay.peak, lay.peak,
                     tuple((k, tuple(v)) for k, v in lay.splits.items()), unit_peaks,
                     np.zeros(len(steps), dtype=np.int8), runs)
