"""Measured selection at plan time: `vbs plan` runs every plan of the served table, every
uniform plan of fbs-best and the larger uniform batches fbs-best passed over in the executor,
as a worker runs them, and at every budget the table gives fbs-best's plan unless another
measured faster there (``planner.solver.selection`` holds the rule).

Why here: running a plan needs the executor and the unit runtimes (workers/), above the
planner, which only builds tables; ``planner.pipeline.prepare`` takes this as its ``select``
step, before the tables are published. The plans of one request size run interleaved, in an
order shuffled anew each round (seeded), so that drift hits them alike, on the same input,
each first checked against ``model(x)``; every plan runs once per round however many budgets
share it, as several calls back to back where one is short (``ROUND_S``): a round's time is
their mean, so a plan of a few milliseconds is not judged by one call's jitter.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from core import runtimes as rt
from core.errors import PlanError
from core.precision import FLOAT_TOLERANCE as TOLERANCE  # a plan's output vs model(x)
from core.runtimes.base import RuntimeOptions
from core.table import Measurements, PlanTable
from core.units import Capture
from planner.solver.compare import BASELINE
from planner.solver.selection import MARGIN, RULE, chosen, larger, to_measure
from workers.executor import execute

log = logging.getLogger("vbs.plan")

# a plan's round lasts at least this long: one call of a small model's plan (1-3 ms) moves by
# 10-20% from call to call here, as much as the margin it must win by (mobilenet_v2 in int8:
# one call of 2 samples ran 0.81-0.98x two calls of one, round by round, 0.98x in the first;
# docs/benchmarks.md section 13), so such a plan runs several calls back to back in its round
ROUND_S = 0.02
MAX_CALLS = 16  # calls of one plan in a round at most


def timed(device: torch.device, fn: Callable[[], Any], calls: int = 1) -> float:
    """Seconds a call of ``fn`` takes, the mean of ``calls`` back to back, the device's queue
    drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()  # its output dropped at once: no more memory held than a served batch holds
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / calls


def calls_per_round(seconds: float) -> int:
    """How many calls of a plan whose call took ``seconds`` make its round (``ROUND_S``)."""
    return max(1, min(MAX_CALLS, math.ceil(ROUND_S / max(seconds, 1e-6))))


def selected(capture: Capture, tables: Mapping[str, PlanTable], solver: str, rounds: int,
             sizes: Collection[int] | None = None, margin: float = MARGIN,
             note: Callable[[str], None] = log.info) -> dict[str, PlanTable]:
    """``tables`` with the ``solver``'s table chosen by measurement over ``rounds`` rounds
    (unchanged where ``rounds`` is 0, the objective is not time, or it is fbs-best itself);
    ``sizes``: only those request sizes' rows (`vbs bench`: the one it runs); ``margin``: how
    much faster than fbs-best's a plan must measure; ``note``: where what it did is said."""
    table = tables[solver]
    if rounds < 1 or solver == BASELINE or table.objective != "time":
        return dict(tables)
    t0 = time.perf_counter()
    seconds = measure(capture, table, tables[BASELINE], rounds, sizes, larger(tables))
    out, done = chosen(tables, solver, Measurements.of(margin, seconds, RULE), sizes)
    assert done is not None
    note(f"{capture.model.spec.name}: {len(seconds)} plans of {solver}, fbs-best and larger "
         "uniform batches measured "
         f"in {time.perf_counter() - t0:.1f} s ({rounds} rounds, table {table.fingerprint}): "
         f"{done.kept} other plans measured faster than fbs-best's at some budget "
         f"and take it, {done.replaced} gave way to it")
    return out


def measure(capture: Capture, table: PlanTable, uniform: PlanTable, rounds: int,
            sizes: Collection[int] | None = None, bigger: PlanTable | None = None
            ) -> dict[str, list[float]]:
    """Seconds of every plan ``to_measure`` names, a call's in each round (the mean of
    ``calls_per_round`` calls), by plan id (``sizes``: of those request sizes only;
    ``bigger``: fbs's table, its batches above fbs-best's)."""
    model = capture.model
    device = model.device
    loaded = {name: rt.load(name, capture, RuntimeOptions())
              for name in sorted(set(table.runtimes) | set(uniform.runtimes))
              if rt.KINDS[name].calls}
    seconds: dict[str, list[float]] = {}
    try:
        for r in sorted(sizes) if sizes is not None else range(1, table.batch_max + 1):
            x = _example(capture, r)
            with torch.inference_mode():
                expected = model.module(x)
            jobs = []
            for t, index in to_measure(table, uniform, r, bigger):
                plan = t.plan(index, r, t.plans[index].peak_bytes)
                job = (lambda p=plan: execute(capture, p.program.steps, x, p.split_map,
                                              p.run_map, loaded))
                _check(job(), expected, plan.plan_id, model.spec.name,
                       capture.precision.tolerance)  # and warm
                jobs.append((plan.plan_id, job, calls_per_round(timed(device, job))))
            order = list(jobs)
            shuffle = random.Random(r).shuffle
            for _ in range(rounds):
                shuffle(order)
                for plan_id, job, calls in order:
                    seconds.setdefault(plan_id, []).append(timed(device, job, calls))
    finally:
        for units in loaded.values():
            units.release()
    return seconds


def _example(capture: Capture, r: int) -> torch.Tensor:
    """The input of r samples every plan runs on: the model's example, or where the
    precision was measured on held-out calibration samples (int8 units), those (repeated to
    r), on which the guard bounded what int8 units move the answer."""
    model = capture.model
    if capture.held_out is None:
        return model.example(r, seed=7)
    held = torch.from_numpy(capture.held_out)
    index = torch.arange(r) % held.shape[0]
    return held[index].to(device=model.device, dtype=model.torch_dtype).contiguous()


def _check(y: torch.Tensor, expected: torch.Tensor, plan_id: str, name: str,
           tolerance: float = TOLERANCE) -> None:
    """``tolerance``: relative to the output's scale (``core.precision.Precision.tolerance``:
    float32's, or wider by what the guard measured of int8 units)."""
    scale = max(1.0, float(expected.abs().max()))
    err = float((y.float() - expected.float()).abs().max())
    if err > tolerance * scale:
        raise PlanError(f"{name}: plan {plan_id} answers differently from model(x) (largest "
                        f"difference {err:.3g}, tolerance {tolerance:.3g} x {scale:.3g}): a "
                        "bug in the executor or a runtime; report it with the model and "
                        "`vbs plan --select-rounds 0` to plan without it")


__all__ = ["MAX_CALLS", "ROUND_S", "calls_per_round", "measure", "selected", "timed"]
