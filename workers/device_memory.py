"""The one owner of a device's memory: what may a request hold, and what may a plan use.

Everything that takes memory on a device is counted here, behind a small interface (as
vLLM's ``KVCacheManager`` owns its blocks): the device's free memory (``MemoryProbe``: the
driver's or the cgroup's reading, a configured cap, what the unit runtimes keep of the
allocator's cache), the one margin kept back for all that is not a plan, the requests' holds
and the idle working set under a cgroup limit (``RequestLedger``), the plans' leases
and shares among the models (``Arbiter``), and on CUDA what the allocator keeps cached after
plans ran, given back when they no longer need it (``DeviceCache``), so that a neighbour can
take it and the reading, and with it the plans, step down; on a CPU under a limit what ONNX
Runtime's arena keeps, given back at rest and when memory is short (``HostCache``). It
answers three questions:

- **may this request in** (``admit``: a ticket, None for "not now", ``RequestTooLargeError``
  for "never"), and what it holds until answered (``resize``, ``keep``, ``done``);
- **what may this plan use** (``allowance``, ``acquire``/``release`` of a lease: the worker
  reads nothing else);
- **do these models fit**, and what a loaded one keeps (``models``: ``workers.models_memory``).

The sizes it plans with (a model's one-sample plan, its working bytes) come from the tables
registered with it (``register``), so no caller hands it callbacks. The HTTP edge of
admission (the estimate of a body's hold from its Content-Length, the line of requests
waiting for room, 413 and 503 with Retry-After) is the service's (``service.admission``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from core.malloc import LARGE_BLOCK, map_large_blocks, trimmer
from core.runtimes.base import UnitRuntime
from core.table import PlanTable
from workers.arbiter import Arbiter, ArbiterListener, Lease, Sized, Snapshot
from workers.cgroup import CgroupMemory, read_cgroup
from workers.device_cache import DeviceCache
from workers.host_cache import HostCache
from workers.ledger import RETURNED_GROWTH, LedgerReport, RequestLedger, Ticket
from workers.memory import MemoryProbe, release_cached
from workers.models_memory import ModelsMemory
from workers.shares import working_bytes

MIN_MARGIN = 16 * 2**20  # kept back under a cgroup limit for Python, the HTTP stack and answers
MARGIN_SHARE = 32        # ... or 1/MARGIN_SHARE of the limit, whichever is more

P = TypeVar("P", bound=Sized)


class DeviceMemory:
    """The memory of one device (``cpu``, ``cuda:0``): see the module doc.

    ``limit`` caps what plans may use whatever the device has free (0: no cap); ``margin``
    is kept back from plans (0 under a cgroup limit: ``MIN_MARGIN`` or 1/``MARGIN_SHARE`` of
    the limit, whichever is more); ``sharing``, ``serial`` and ``listener`` are the arbiter's
    (``workers.arbiter``); ``read`` and ``trim`` the ledger's reading of the cgroup and its
    allocator trim (tests give recorded ones); ``cache_idle_s``: how long the device stays
    idle before the allocator's cache (CUDA) or ONNX Runtime's arena (a CPU under a limit,
    ``ort_arena`` auto) is given back (0: only when a smaller plan runs, or memory is short);
    ``total`` the most the loaded models may keep and their plans use, all together (0: no
    such cap; ``models_capacity``). ``ort_arena``: whether ONNX Runtime's arena keeps what a
    call used (shared), gives it back when the call returns (none), or, where a cgroup limit
    applies, keeps it while plans run and gives it back at rest (after ``cache_idle_s``) and
    when memory is short (auto: ``host_cache``, whose hooks the runtimes register). ``arena``
    says whether a call keeps what it used, ``gives_back`` whether what calls used leaves the
    process (then the allocator maps large blocks alone, and a plan counts
    ``RETURNED_GROWTH`` times its bytes), for the runtimes this device's models load.
    """

    def __init__(self, device: str, *, limit: int = 0, margin: int = 0,
                 sharing: str = "arbiter", serial: bool = False,
                 listener: ArbiterListener | None = None,
                 read: Callable[[], CgroupMemory | None] = read_cgroup,
                 trim: Callable[[], None] | None = None, cache_idle_s: float = 1.0,
                 total: int = 0, ort_arena: str = "shared") -> None:
        self.device = device
        self.probe = MemoryProbe(device, limit=limit)
        self._margin = margin
        self.total = total  # the most loaded models keep and their plans use together (0: none)
        self.models = ModelsMemory(self)  # what loaded models keep; which fit
        self.host_cache: HostCache | None = None
        given_trim = trim is not None  # tests pass their own
        # the C allocator's free pages back to the kernel (looked up once: it reads the
        # interpreter and asks ldconfig)
        self._trim = trim if trim is not None else trimmer()
        self._ledger = RequestLedger(self._leased, self.one_sample_bytes, self.working_bytes,
                                     self.margin, read=read, trim=self._trim,
                                     give_back=self._give_back)
        # requests are counted only on a CPU under a cgroup memory limit, where the kernel
        # kills the process; elsewhere the ledger only reports the group
        self.ledger = self._ledger if device == "cpu" and self._ledger.active else None
        if ort_arena == "auto" and self.ledger is not None:
            self.host_cache = HostCache(cache_idle_s, rested=self._ledger.rebase)
        self.arena = ort_arena != "none"
        # where what a call used leaves the process (when it returns, or when it is short), a
        # plan grows the group by its own bytes, not by what the arena kept of plans before it
        self.gives_back = ort_arena == "none" or self.host_cache is not None
        if self.gives_back:
            self._ledger.growth = RETURNED_GROWTH
            if not given_trim:  # the process's own allocator
                map_large_blocks(LARGE_BLOCK)  # what calls give back leaves the process
        self.arbiter = Arbiter(device, self.plan_free, mode=sharing, serial=serial,
                               ceiling=self.ceiling if self.ledger is not None else None,
                               listener=listener)
        self.cache = DeviceCache(device, cache_idle_s) if device.startswith("cuda") else None

    def _leased(self) -> int:
        return self.arbiter.leased

    def _give_back(self) -> bool:
        return self.host_cache.give_back() if self.host_cache is not None else False

    # ------------------------------------------------------------------ the one margin

    def margin(self, limit: int | None = None) -> int:
        """What is kept back from plans: the configured margin, or under a cgroup limit of
        ``limit`` bytes, when none is configured, ``MIN_MARGIN`` or 1/``MARGIN_SHARE`` of it."""
        if limit is None:
            return self._margin
        return self._margin or max(MIN_MARGIN, limit // MARGIN_SHARE)

    # ------------------------------------------------------------------ what plans may use

    def plan_free(self) -> int:
        """Bytes free for plans now, all models together (the arbiter's budget reads it)."""
        reading = self.ledger.reading() if self.ledger is not None else None
        if reading is None:
            free = max(0, self.probe.free() - self.margin())
        else:
            free = self.ledger.plan_free(reading)  # type: ignore[union-attr]
            free = min(free, self.probe.limit) if self.probe.limit else free
        if self.total:  # what loaded models keep is under the same cap
            free = min(free, max(0, self.total - self.models.kept_total() - self.margin()))
        return free

    def ceiling(self) -> int:
        """The most plans could get with nothing held (under a cgroup limit): a batch whose
        one-sample plan fits below it waits for memory, one above it never runs."""
        reading = self.ledger.reading() if self.ledger is not None else None
        if reading is None:
            return self.plan_free()
        most = self.ledger.ceiling(reading)  # type: ignore[union-attr]
        return min(most, self.probe.limit) if self.probe.limit else most

    def register(self, model: str, table: Callable[[], PlanTable], demand: Callable[[], int],
                 *, weight: float = 1.0, minimum: int = 0) -> None:
        """Count model ``model`` from now on: its plans lease from this device, its table
        sizes its requests' room."""
        self.arbiter.register(model, table, demand, weight=weight, minimum=minimum)

    def one_sample_bytes(self, model: str | None = None) -> int:
        """The bytes of ``model``'s one-sample plan (None or unknown: the largest of the
        models registered; 0 when none is)."""
        tables = self.arbiter.tables()
        if model in tables:
            return int(tables[model].min_peaks[0])
        return max((int(t.min_peaks[0]) for t in tables.values()), default=0)

    def working_bytes(self, model: str | None = None) -> int:
        """The bytes at which ``model``'s batches run at working speed
        (``workers.shares.working_bytes``; None or unknown: the largest; 0 when none)."""
        tables = self.arbiter.tables()
        if model in tables:
            return working_bytes(tables[model])
        return max((working_bytes(t) for t in tables.values()), default=0)

    def budget(self) -> int:
        """What plans may use now, all models together (reads the device)."""
        return self.arbiter.budget()

    def allowance(self, model: str) -> int:
        """Bytes ``model``'s next batch may plan for: its share now."""
        return self.arbiter.allowance(model)

    def acquire(self, model: str, pick: Callable[[int], P | None], *, need: int,
                timeout_s: float) -> Lease[P]:
        """A lease for ``model``'s next piece (``workers.arbiter.Arbiter.acquire``)."""
        for cache in (self.cache, self.host_cache):
            if cache is not None:
                cache.busy()
        return self.arbiter.acquire(model, pick, need=need, timeout_s=timeout_s)

    def release(self, lease: Lease[Any]) -> None:
        """Return a lease (on CUDA, the allocator's cache beyond what live plans and a plan of
        its size need is given back; once none is live, after ``cache_idle_s``)."""
        self.arbiter.release(lease)
        if self.cache is not None:
            live = self.arbiter.leased
            self.cache.done(live + lease.bytes)
            if not live:
                self.cache.idle()
        if self.host_cache is not None:
            self.host_cache.used()
            if not self.arbiter.leased:
                self.host_cache.idle()

    def runtime_loaded(self, runtime: UnitRuntime) -> None:
        """A worker loaded ``runtime``: what its calls leave cached is given back with the
        device's caches (at rest, when memory is short, after an unload: ``host_cache``)."""
        if self.host_cache is not None:
            self.host_cache.register(runtime.give_back)

    def runtime_released(self, runtime: UnitRuntime) -> None:
        if self.host_cache is not None:
            self.host_cache.unregister(runtime.give_back)

    def give_back_cached(self) -> None:
        """Give back what the device's caches keep that no plan or model uses now (after a
        model's unload): the CUDA allocator's cached blocks, ONNX Runtime's arena, and on the
        CPU the free pages the C allocator keeps (an unloaded model's graphs and sessions were
        many small blocks: without it, what they took stayed in the process)."""
        release_cached(self.device)
        if self.host_cache is not None:
            self.host_cache.give_back()
        if self.device.startswith("cpu"):
            self._trim()

    def close(self) -> None:
        """Stop the caches' idle threads (the service is stopping)."""
        for cache in (self.cache, self.host_cache):
            if cache is not None:
                cache.close()

    def shares(self) -> dict[str, int]:
        """Every model's share of the last budget read."""
        return self.arbiter.shares()

    def sharing(self) -> dict[str, Any]:
        """How the budget is shared now (the device is not read): the mode
        (``workers.arbiter.MODES``), every model's share, what plans could use at the last
        reading, and what is leased."""
        arbiter = self.arbiter
        return {"mode": arbiter.mode, "shares": arbiter.shares(),
                "budget_bytes": arbiter.last_budget, "leased_bytes": arbiter.leased}

    # ------------------------------------------------------------------ what requests hold

    @property
    def counts_requests(self) -> bool:
        """Whether requests are admitted against a ledger (a cgroup memory limit applies)."""
        return self.ledger is not None

    def admit(self, model: str | None, hold: int, what: str = "request") -> Ticket | None:
        """A place for a request that will hold about ``hold`` bytes: a ticket, or None when
        there is no room now; RequestTooLargeError when there never is. Without a ledger,
        nothing is counted: a ticket that holds nothing."""
        if self.ledger is None:
            return Ticket(0, model)
        return self.ledger.admit(model, hold, what)

    def refused(self) -> str:
        """A request waited for room in vain (counted); what holds the memory, in words."""
        return self.ledger.refused_busy() if self.ledger is not None else "nothing"

    def resize(self, ticket: Ticket | None, hold: int) -> None:
        if self.ledger is not None:
            self.ledger.resize(ticket, hold)

    def keep(self, ticket: Ticket | None, data: object) -> None:
        if self.ledger is not None:
            self.ledger.keep(ticket, data)

    def done(self, ticket: Ticket | None) -> None:
        """The request has been answered (or refused): see ``RequestLedger.release``."""
        if self.ledger is not None:
            self.ledger.release(ticket)

    def rebase(self) -> None:
        """Read what stays when nothing is held (after a model loads: its weights, buffers)."""
        if self.ledger is not None:
            self.ledger.rebase()

    # ------------------------------------------------------------------ what loaded models keep

    def idle_moved(self, change: int) -> None:
        """Under a cgroup limit, the ledger's idle working set moved by ``change`` (a model
        loaded or unloaded: ``models``)."""
        if self.ledger is not None:
            self.ledger.move_idle(change)

    def in_use(self) -> int | None:
        """Under a cgroup limit, the group's working set now (None elsewhere)."""
        reading = self.ledger.reading() if self.ledger is not None else None
        return reading.working_set if reading is not None else None

    @property
    def growth(self) -> float:
        """How many times its bytes a plan counts against the memory it runs in (the ledger's
        under a cgroup limit, else 1)."""
        return self._ledger.growth if self.ledger is not None else 1.0

    # ------------------------------------------------------------------ reports

    def report(self) -> LedgerReport:
        """The memory under the limit (held, leased, what plans may use), for ``/models``."""
        if self.ledger is None:
            return self._ledger.report(None, self.margin(), counting=False)
        return self.ledger.report(self.plan_free(), self.margin())

    def snapshot(self) -> Snapshot:
        """The arbiter's state: budget, shares, leases, waits (``GET /models``)."""
        return self.arbiter.snapshot()
