"""A worker: one model, its plan table, and the memory free now → the plan that fits → outputs.

Per batch of r samples: read the memory free now, walk down the table's plans for r from the
one the table gives for that memory, and take the first whose *executor* peak (what
``workers.walk`` allocates, which can be above the solver's claim) fits. If none fits, the
batch is split in two and each half planned on its own; a single sample that cannot fit is an
InfeasibleError saying how much memory is missing. If the device still runs out of memory
(another process took some meanwhile), the allocator's cache is released, the plan steps down
to a smaller budget and the batch is retried: a batch is never lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from planner.errors import InfeasibleError, OutOfMemoryError, UsageError
from planner.graph.capture import Capture
from planner.solver.program import Plan
from planner.solver.table import PlanTable
from planner.tree import Profile, iter_layers
from workers.executor import execute
from workers.memory import MemoryProbe
from workers.walk import BufferPlan, executor_peak, plan_splits

log = logging.getLogger("vbs.worker")


@dataclass(frozen=True)
class Choice:
    """The plan picked for one batch: the solver's plan and how the executor lays it out."""

    plan: Plan
    buffers: BufferPlan
    free_bytes: int  # the memory free when it was picked

    @property
    def peak_bytes(self) -> int:
        return self.buffers.peak


@dataclass(frozen=True)
class RunInfo:
    """What one batch cost: the plans that ran it, and the retries on the way."""

    choices: tuple[Choice, ...]
    oom_retries: int
    splits: int


@dataclass
class WorkerStats:
    """Counters the service exports as metrics."""

    batches: int = 0
    oom_retries: int = 0
    splits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, info: RunInfo) -> None:
        with self.lock:
            self.batches += 1
            self.oom_retries += info.oom_retries
            self.splits += info.splits


class Worker:
    """Runs batches of one captured model with the table's plan for the memory free now."""

    def __init__(self, capture: Capture, profile: Profile, table: PlanTable, probe: MemoryProbe,
                 *, max_oom_retries: int = 4) -> None:
        self.capture = capture
        self.profile = profile
        self.probe = probe
        self.max_oom_retries = max_oom_retries
        self.stats = WorkerStats()
        self._ws = {layer.name: layer.ws for layer in iter_layers(profile.root)}
        self._buffers: dict[tuple[str, int], BufferPlan] = {}
        self._walks: dict[tuple[str, int], BufferPlan] = {}
        self._lock = threading.Lock()
        self.table = table

    @property
    def table(self) -> PlanTable:
        return self._table

    @table.setter
    def table(self, table: PlanTable) -> None:
        """A new table (the planner published one): later batches use it."""
        if table.batch_max > self.profile.batch_max:
            raise UsageError(f"the table plans up to {table.batch_max} samples but the profile "
                             f"only measured {self.profile.batch_max}")
        self._table = table
        self._plans: dict[int, list[Plan]] = {}  # per request size, by descending breakpoint

    @property
    def batch_max(self) -> int:
        return self._table.batch_max

    @property
    def request_bytes_per_sample(self) -> int:
        return self.profile.root.in_bytes

    def buffers(self, plan: Plan) -> BufferPlan:
        """How the executor lays out ``plan`` at its lowest peak, splits included (cached)."""
        return self._cached(self._buffers, plan, lambda: plan_splits(
            self.profile.root, self._ws, plan.program.steps, plan.batch))

    def _plain(self, plan: Plan) -> BufferPlan:
        """The executor's layout of ``plan`` without splits: one walk (cached)."""
        def walk() -> BufferPlan:
            peak = executor_peak(self.profile.root, self._ws, plan.program.steps, plan.batch)
            return BufferPlan({}, peak, peak)
        return self._cached(self._walks, plan, walk)

    def _cached(self, cache: dict[tuple[str, int], BufferPlan], plan: Plan,
                make: Callable[[], BufferPlan]) -> BufferPlan:
        key = (plan.plan_id, plan.batch)
        with self._lock:
            found = cache.get(key)
        if found is None:
            found = make()
            with self._lock:
                cache[key] = found
        return found

    def choose(self, r: int, free: int) -> Choice:
        """The fastest plan of r samples whose executor peak fits in ``free`` bytes.

        Plans by descending breakpoint are ever slower. A plan whose claimed exact peak is
        above what is free (plus the request, which the solver counts and which is allocated
        already) is passed over without a walk; the others are walked, plainly first, and
        with the split search (many walks) only when the plain layout does not fit. Every
        answer is cached, so a request size costs its walks once per table.
        """
        ceiling = free + self.request_bytes_per_sample * r
        plans = self._plans.get(r)
        if plans is None:  # building Plans from the table is not free: once per table and r
            plans = [plan for _, plan in reversed(self._table.plans_for(r))]
            self._plans[r] = plans
        smallest = None
        for k, plan in enumerate(plans):
            if plan.peak_bytes > ceiling and k < len(plans) - 1:
                continue
            for layout in (self._plain, self.buffers):
                buffers = layout(plan)
                if buffers.peak <= free:
                    return Choice(plan, buffers, free)
                smallest = buffers.peak if smallest is None else min(smallest, buffers.peak)
        smallest = smallest or 0
        raise InfeasibleError(f"{self.capture.model.spec.name}: no plan of {r} samples fits in "
                              f"{free} free bytes; the smallest needs {smallest}, "
                              f"{max(0, smallest - free)} bytes more")

    def infer(self, x: torch.Tensor, free: Callable[[], int] | None = None) -> tuple[torch.Tensor, RunInfo]:
        """``model(x)`` for a batch of any size, within the memory free when it runs."""
        read_free = free or self.probe.free
        chunks = x.split(self.batch_max) if x.shape[0] > self.batch_max else (x,)
        outputs: list[torch.Tensor] = []
        choices: list[Choice] = []
        counts = [0, 0]  # oom retries, splits
        for chunk in chunks:
            outputs.extend(self._run(chunk, read_free, choices, counts))
        info = RunInfo(tuple(choices), counts[0], counts[1] + len(chunks) - 1)
        self.stats.add(info)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), info

    def _run(self, x: torch.Tensor, read_free: Callable[[], int], choices: list[Choice],
             counts: list[int]) -> list[torch.Tensor]:
        r = x.shape[0]
        free = read_free()

        def split() -> list[torch.Tensor]:
            counts[1] += 1
            half = r // 2
            return (self._run(x[:half], read_free, choices, counts)
                    + self._run(x[half:], read_free, choices, counts))

        for attempt in range(self.max_oom_retries + 1):
            try:
                choice = self.choose(r, free)
            except InfeasibleError:
                if r == 1:
                    raise
                return split()
            try:
                y = execute(self.capture, choice.plan.program.steps, x, choice.buffers.splits)
            except OutOfMemoryError as exc:
                counts[0] += 1
                log.warning("%s; retry %d with a smaller plan", exc, attempt + 1)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                # Step down: below what just failed, and below what is free now.
                free = min(read_free(), choice.peak_bytes - 1)
                continue
            choices.append(choice)
            return [y]
        if r > 1:
            return split()
        raise OutOfMemoryError(f"{self.capture.model.spec.name}: still out of memory after "
                               f"{self.max_oom_retries} smaller plans for {r} samples")
