"""One memory arbiter per device: every batch leases its plan's exact peak before it runs, and
the leases alive at once never add up to more than the memory free for plans.

Why: models whose workers read the free memory each on its own plan for the same bytes when
their batches start together (an out-of-memory error on CUDA, the OOM killer on a CPU pod). A
worker leases before each piece of a batch runs and returns the lease when it ends, on error
too. The budget is the probe's reading taken when no lease was alive, lowered if the device
has less now, never raised while leases live.

Shares (``mode``): ``arbiter`` divides the budget from the tables by demand (a knapsack over
each model's time per sample against memory, ``workers.shares``), recomputed only when a
demand level, a table or the budget changes; ``static``, equal shares by weight; ``none``,
no enforcement (leases recorded, overcommits counted: every model plans for all the free
memory). A
batch that cannot get its share takes a smaller plan that fits what is free (a step-down) or
waits in one FIFO line per device, so nothing starves; it gives up with LeaseTimeoutError only
after its timeout. A batch whose one-sample plan needs more than is free fails at once
(InfeasibleError), unless a ``ceiling`` says the most the budget can become (under a memory
limit, with nothing else held): below it, the batch waits for the memory, and gives up after
``STARVED_S`` when no lease is alive to free any (what holds it waits for this batch). Every grant checks the sum of live leases against the budget; a listener
(the service's metrics) hears budgets, shares, leases, waits and step-downs.
docs/architecture.md, "Several models on one device", says more.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from core.errors import InfeasibleError, LeaseTimeoutError, UsageError
from core.runtimes.base import UnitRuntime
from core.table import PlanTable
from workers.shares import LEVELS, Want, demand_level, divide

log = logging.getLogger("vbs.arbiter")

MODES = ("arbiter", "static", "none")
REREAD_S = 0.1  # a waiting batch re-reads the device this often (another process may free memory)
STARVED_S = 1.0  # under a ceiling, a batch gives up after this long with nothing leased


class Sized(Protocol):
    """What a worker's pick returns: a plan choice and the bytes it allocates."""

    @property
    def peak_bytes(self) -> int: ...


P = TypeVar("P", bound=Sized)


class ArbiterListener(Protocol):
    """What the arbiter reports (called with its lock held: keep it quick)."""

    def on_register(self, device: str, model: str) -> None: ...

    def on_budget(self, device: str, budget: int) -> None: ...

    def on_shares(self, shares: Mapping[str, int]) -> None: ...

    def on_lease(self, model: str, leased: int) -> None: ...  # bytes the model holds now

    def on_wait(self, model: str) -> None: ...

    def on_step_down(self, model: str) -> None: ...

    def on_overcommit(self, device: str) -> None: ...


@dataclass(frozen=True)
class Lease(Generic[P]):
    """Bytes leased to one model's batch (or piece), and how it got them."""

    model: str
    bytes: int
    choice: P              # what the worker picked for the bytes it could take
    budget: int            # the memory free for plans when it was granted
    leased_after: int      # the sum of live leases right after the grant
    waited_s: float        # time from asking to the grant
    waited: bool           # it queued behind others
    stepped_down: bool     # a smaller plan than its share would give: others held the rest
    token: int = field(repr=False, default=0)


class Leases(Protocol):
    """What a worker asks of a device's memory (an ``Arbiter``, or the device's owner that
    holds one, ``workers.device_memory``): its share, and leases."""

    def allowance(self, model: str) -> int: ...

    def acquire(self, model: str, pick: Callable[[int], P | None], *, need: int,
                timeout_s: float) -> Lease[P]: ...

    def release(self, lease: Lease[Any]) -> None: ...

    def runtime_loaded(self, runtime: UnitRuntime) -> None: ...

    def runtime_released(self, runtime: UnitRuntime) -> None: ...


@dataclass(frozen=True)
class Claim:
    """A model the arbiter divides memory for."""

    name: str
    table: Callable[[], PlanTable]  # the table it serves now
    demand: Callable[[], int]       # queued + running samples
    weight: float = 1.0
    minimum: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The arbiter's state, for /models and tests."""

    device: str
    mode: str
    serial: bool
    budget_bytes: int
    leased_bytes: int
    high_water_bytes: int
    grants: int
    overcommits: int
    min_headroom_bytes: int | None  # the least (budget - live leases) seen right after a grant
    waiting: int
    shares: dict[str, int]
    leases: dict[str, int]
    demand: dict[str, int]
    waits: dict[str, int]
    step_downs: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "mode": self.mode, "serial": self.serial,
                "budget_bytes": self.budget_bytes, "leased_bytes": self.leased_bytes,
                "high_water_bytes": self.high_water_bytes, "grants": self.grants,
                "overcommits": self.overcommits, "min_headroom_bytes": self.min_headroom_bytes,
                "waiting": self.waiting, "shares": self.shares, "leases": self.leases,
                "demand": self.demand, "waits": self.waits, "step_downs": self.step_downs}


class Arbiter:
    """Leases and shares of one device's memory (see the module doc)."""

    def __init__(self, device: str, read_free: Callable[[], int], *, mode: str = "arbiter",
                 serial: bool = False, listener: ArbiterListener | None = None,
                 levels: int = LEVELS, ceiling: Callable[[], int] | None = None) -> None:
        if mode not in MODES:
            raise UsageError(f"memory_sharing {mode!r}: use one of {', '.join(MODES)}")
        self.device = device
        self.mode = mode
        self.serial = serial
        self.listener = listener
        self.levels = levels
        self._read_free = read_free
        self._ceiling = ceiling  # the most plans could get: a need above it never fits
        self._cond = threading.Condition()
        self._claims: dict[str, Claim] = {}
        self._live: dict[int, tuple[str, int]] = {}
        self._by_model: dict[str, int] = {}
        self._leased = 0
        self._queue: deque[int] = deque()
        self._tokens = itertools.count(1)
        self._idle_reading: int | None = None
        self._budget = 0
        self._shares: dict[str, int] = {}
        self._share_key: tuple[Any, ...] | None = None
        self._share_budget = 0
        self._grants = 0
        self._overcommits = 0
        self._high_water = 0
        self._min_headroom: int | None = None
        self._waits: dict[str, int] = {}
        self._step_downs: dict[str, int] = {}

    # ------------------------------------------------------------------ models

    def register(self, name: str, table: Callable[[], PlanTable], demand: Callable[[], int], *,
                 weight: float = 1.0, minimum: int = 0) -> None:
        """Divide memory for model ``name`` too (its table and demand are read when shares
        are recomputed)."""
        if not weight > 0:
            raise UsageError(f"memory weight of {name!r} must be > 0, got {weight!r}")
        with self._cond:
            self._claims[name] = Claim(name, table, demand, float(weight), max(0, int(minimum)))
            self._by_model.setdefault(name, 0)
            self._waits.setdefault(name, 0)
            self._step_downs.setdefault(name, 0)
            self._share_key = None
            if self.listener is not None:
                self.listener.on_register(self.device, name)

    # ------------------------------------------------------------------ queries

    def tables(self) -> dict[str, PlanTable]:
        """The table each registered model serves now (no lock: read by the memory owner while
        this arbiter's lock may be held elsewhere in the same call chain)."""
        return {c.name: c.table() for c in list(self._claims.values())}

    @property
    def leased(self) -> int:
        """Bytes leased now, all models together."""
        return self._leased

    @property
    def high_water(self) -> int:
        """The most bytes leased at once so far."""
        return self._high_water

    @property
    def overcommits(self) -> int:
        """Grants after which live leases exceeded the budget (0 unless mode is ``none``)."""
        return self._overcommits

    @property
    def grants(self) -> int:
        return self._grants

    @property
    def min_headroom(self) -> int | None:
        """The least (budget - live leases) right after any grant: >= 0 means never over."""
        return self._min_headroom

    @property
    def last_budget(self) -> int:
        """The memory free for plans at the last reading (the device is not read)."""
        return self._budget

    def budget(self) -> int:
        """The memory free for plans now (reads the device)."""
        reading = self._read()
        with self._cond:
            return self._budget_of(reading)

    def allowance(self, model: str) -> int:
        """Bytes ``model``'s next batch may plan for: its share now (reads the device)."""
        reading = self._read()
        with self._cond:
            budget = self._budget_of(reading)
            return self._shares_now(budget).get(model, budget)

    def shares(self) -> dict[str, int]:
        """Every model's share of the last budget read (recomputed if demand changed)."""
        with self._cond:
            return dict(self._shares_now(self._budget))

    def snapshot(self) -> Snapshot:
        """The state now, from the last budget read (the device is not read)."""
        with self._cond:
            shares = dict(self._shares_now(self._budget))
            return Snapshot(
                device=self.device, mode=self.mode, serial=self.serial,
                budget_bytes=self._budget, leased_bytes=self._leased,
                high_water_bytes=self._high_water, grants=self._grants,
                overcommits=self._overcommits, min_headroom_bytes=self._min_headroom,
                waiting=len(self._queue), shares=shares, leases=dict(self._by_model),
                demand={c.name: max(0, int(c.demand())) for c in self._claims.values()},
                waits=dict(self._waits), step_downs=dict(self._step_downs))

    # ------------------------------------------------------------------ leases

    def acquire(self, model: str, pick: Callable[[int], P | None], *, need: int,
                timeout_s: float) -> Lease[P]:
        """A lease for ``model``'s next piece: ``pick(bytes)`` (called with the lock held: a
        table lookup) returns the plan for at most that many bytes, or None when none fits;
        ``need`` is the bytes of its smallest plan (one sample). See the module doc's rule."""
        started = time.monotonic()
        deadline = started + timeout_s
        reading = self._read()
        with self._cond:
            budget = self._budget_of(reading)
            self._check_need(model, need, budget)
            if self.mode == "none":  # every model plans for all the memory free now
                choice = pick(reading)
                if choice is None:
                    raise InfeasibleError(f"{model}: no plan of one sample fits in {reading} "
                                          f"free bytes; it needs {need}, {need - reading} more")
                return self._grant(model, choice, budget, started, waited=False, stepped=False)
            ticket = next(self._tokens)
            queued = False
            try:
                if self._queue:  # others wait: behind them
                    self._enqueue(model, ticket)
                    queued = True
                while True:
                    if not self._queue or self._queue[0] == ticket:
                        lease = self._try(model, pick, need, budget, started, queued)
                        if lease is not None:
                            if queued:
                                self._queue.popleft()
                                queued = False
                                self._cond.notify_all()
                            return lease
                        if not queued:
                            self._enqueue(model, ticket)
                            queued = True
                    now = time.monotonic()
                    remaining = deadline - now
                    if (self._ceiling is not None and not self._live
                            and now - started > STARVED_S):
                        # nothing leased will come back: what holds the memory is waiting
                        # for this batch (its own requests, others queued behind it)
                        raise LeaseTimeoutError(
                            f"{model}: waited {now - started:.1f} s for the {need} bytes of a "
                            f"one-sample plan, but only {budget} are free for plans on "
                            f"{self.device} and no batch is running to free more: the "
                            "requests waiting hold the rest of the memory limit; retry")
                    if remaining <= 0:
                        raise LeaseTimeoutError(
                            f"{model}: waited {timeout_s:.1f} s for {need} bytes of memory "
                            f"while other models' batches held {self._leased} of the "
                            f"{budget} free for plans on {self.device}; raise the memory "
                            "limit, serve fewer models on this device, or retry")
                    self._cond.wait(min(remaining, REREAD_S))
                    self._cond.release()  # read the device without holding the lock
                    try:
                        reading = self._read()
                    finally:
                        self._cond.acquire()
                    budget = self._budget_of(reading)
                    self._check_need(model, need, budget)
            finally:
                if queued:  # gave up (timeout, error): the next in line may go
                    self._queue.remove(ticket)
                    self._cond.notify_all()

    def runtime_loaded(self, runtime: UnitRuntime) -> None:
        """No caches of its own to give back (the device's memory owner keeps them)."""

    runtime_released = runtime_loaded

    def release(self, lease: Lease[Any]) -> None:
        """Return a lease (a second return of the same lease does nothing)."""
        with self._cond:
            found = self._live.pop(lease.token, None)
            if found is None:
                return
            model, size = found
            self._leased -= size
            self._by_model[model] = self._by_model.get(model, 0) - size
            if self.listener is not None:
                self.listener.on_lease(model, self._by_model[model])
            self._cond.notify_all()

    # ------------------------------------------------------------------ inside the lock

    def _read(self) -> int:
        return max(0, int(self._read_free()))

    def _budget_of(self, reading: int) -> int:
        if not self._live or self._idle_reading is None:
            self._idle_reading = reading
            budget = reading
        else:
            budget = min(self._idle_reading, reading + self._leased)
        if budget != self._budget and self.listener is not None:
            self.listener.on_budget(self.device, budget)
        self._budget = budget
        return budget

    def _check_need(self, model: str, need: int, budget: int) -> None:
        if self._ceiling is not None:  # below it, a batch waits for the memory (see acquire)
            budget = max(0, int(self._ceiling()))
        if need > budget:
            raise InfeasibleError(
                f"{model}: its smallest plan (one sample) needs {need} bytes, but only {budget} "
                f"are free for plans on {self.device}, {need - budget} bytes more; raise the "
                "memory limit or serve fewer models on this device")

    def _shares_now(self, budget: int) -> dict[str, int]:
        claims = list(self._claims.values())
        if self.mode == "none" or (self.mode == "arbiter" and self.serial):
            shares = {c.name: budget for c in claims}
        elif self.mode == "static":
            weights = sum(c.weight for c in claims)
            shares = {c.name: int(budget * c.weight / weights) for c in claims}
        else:  # the knapsack: only when a demand level, a table or the budget changed
            tables = [c.table() for c in claims]
            levels = tuple(demand_level(c.demand()) for c in claims)
            key = (tuple(c.name for c in claims), levels, tuple(map(id, tables)))
            if key == self._share_key and \
                    abs(budget - self._share_budget) <= self._share_budget >> 6:
                return self._shares
            shares = divide(budget, [Want(c.name, t, lvl, c.weight, c.minimum)
                                     for c, t, lvl in zip(claims, tables, levels)], self.levels)
            self._share_key, self._share_budget = key, budget
        if shares != self._shares:
            self._shares = shares
            if self.listener is not None:
                self.listener.on_shares(shares)
        return self._shares

    def _enqueue(self, model: str, ticket: int) -> None:
        self._queue.append(ticket)
        self._waits[model] = self._waits.get(model, 0) + 1
        if self.listener is not None:
            self.listener.on_wait(model)

    def _try(self, model: str, pick: Callable[[int], P | None], need: int, budget: int,
             started: float, waited: bool) -> Lease[P] | None:
        free = budget - self._leased
        if free < need:
            return None
        target = max(self._shares_now(budget).get(model, budget), need)
        take = min(target, free)
        choice = pick(take)
        if choice is None:
            return None
        stepped = False
        if take < target:
            full = pick(target)
            stepped = full is not None and full.peak_bytes > choice.peak_bytes
        return self._grant(model, choice, budget, started, waited=waited, stepped=stepped)

    def _grant(self, model: str, choice: P, budget: int, started: float, *, waited: bool,
               stepped: bool) -> Lease[P]:
        size = int(choice.peak_bytes)
        token = next(self._tokens)
        self._live[token] = (model, size)
        self._leased += size
        self._by_model[model] = self._by_model.get(model, 0) + size
        self._grants += 1
        self._high_water = max(self._high_water, self._leased)
        headroom = budget - self._leased
        self._min_headroom = headroom if self._min_headroom is None else min(self._min_headroom,
                                                                            headroom)
        if headroom < 0:  # only where leases are not enforced (mode none)
            self._overcommits += 1
            if self.mode != "none":
                log.error("%s: lease of %d bytes took %s past its budget %d (%d leased): a bug",
                          model, size, self.device, budget, self._leased)
        if stepped:
            self._step_downs[model] = self._step_downs.get(model, 0) + 1
        if self.listener is not None:
            self.listener.on_lease(model, self._by_model[model])
            if headroom < 0:
                self.listener.on_overcommit(self.device)
            if stepped:
                self.listener.on_step_down(model)
        return Lease(model, size, choice, budget, self._leased, time.monotonic() - started,
                     waited, stepped, token)
