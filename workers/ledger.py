"""What requests hold under a cgroup memory limit, beside the idle working set and the plans.

Why: inside a cgroup limit the kernel kills the whole process when the group's working set
reaches the limit, and every request waiting in the queue holds its body and decoded input
before any plan runs. So, when a limit applies (``workers.cgroup``), the memory under it is
kept as a ledger:

    limit = idle working set + what admitted requests hold + growth x live leases + margin

The idle working set is read whenever nothing is held or leased (weights, runtimes, caches:
what stays), after giving the allocator's free pages back (``malloc_trim``); blocks of 1 MiB
and more (bodies, samples) are mapped alone and given back when freed (``mallopt``), or the
allocator's per-thread heaps would keep them and the idle use would grow through a burst until
no plan fits. A request is admitted before its body is read, on its estimated hold: it and
the plans' working bytes (what a full batch needs to run near its best speed, or as much of
it as the limit leaves beside this request, at least a one-sample plan) must fit in the
ledger, and what is not in the group yet (bodies unread, plans not allocated) in the group's
headroom read now: a request decoded early gains nothing, while the batch it starves runs one
sample at a time. One that would not fit even in an idle server is refused at once
(``RequestTooLargeError``). Plans may use what the ledger leaves, less a reserve for requests
arriving meanwhile (never below their working bytes), and never more than the group's
headroom read now (``plan_free``). Where the group is short while the ledger is not, what
the runtimes keep of calls before (ONNX Runtime's arena, ``workers.host_cache``) is given
back and the group read again, before a request waits or a plan gets less than its working
bytes. The ledger is a part of the device's memory owner (``workers.device_memory``), which
gives it the live leases, the plans' sizes, the margin and that give-back.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.errors import RequestTooLargeError
from core.malloc import LARGE_BLOCK, map_large_blocks, trimmer
from workers.cgroup import CgroupMemory, read_cgroup

RESERVE_SHARE = 8       # plans leave 1/RESERVE_SHARE of the memory for requests arriving meanwhile
REBASE_S = 0.5           # the idle working set is read at most this often
# a plan's first runs grow the group by up to this times its bytes (ONNX Runtime's arena and
# the allocator round and keep what they were asked for, its sessions are made): a lease
# counts this many times against the limit (docs/operations.md, "Sizing a memory limit")
GROWTH = 2.0
# ... where the arena gives its free regions back when each call returns and large blocks are
# unmapped when freed: what a plan allocates leaves the group with it (the resident set's peak
# while a plan runs stays within its claim: tests/core/test_runtimes.py, ``rss_child``); the
# rest is for a session's first call and pages rounded up
RETURNED_GROWTH = 1.25


@dataclass(frozen=True)
class Ticket:
    """One admitted request's place in the ledger."""

    token: int
    model: str | None
    waited_s: float = 0.0  # in line for memory: it counts toward the request's timeout


@dataclass(frozen=True)
class LedgerReport:
    """The memory under the limit as the ledger sees it now (for ``GET /models``)."""

    limit_bytes: int | None          # the tightest cgroup limit on this process's path
    limit_group: str | None          # the group that sets it
    cgroup_version: int | None
    working_set_bytes: int | None    # that group's working set now (usage - inactive files)
    idle_working_set_bytes: int | None  # when nothing was held or leased
    margin_bytes: int
    held_bytes: int                  # what admitted requests hold (estimated until decoded)
    requests: int                    # admitted, not yet answered
    leased_bytes: int                # live plan leases
    plans_may_use_bytes: int | None  # what the plans may use now
    admitted: int
    refused_busy: int                # would fit an idle server, not now (503)
    refused_too_large: int           # would not fit even an idle server (413)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RequestLedger:
    """The ledger of one CPU device under a cgroup memory limit (see the module doc).

    ``leased`` reads the live leases; ``need`` the bytes of a one-sample plan of a model
    (None: the largest of the models served); ``want`` the bytes at which its batches run at
    working speed; ``margin`` the margin kept back under a limit of so many bytes. ``growth``
    is how many times its bytes a plan counts (``GROWTH``, or ``RETURNED_GROWTH`` where the
    runtimes keep nothing of a call, or give it back when short: the memory owner sets it).
    ``give_back`` gives back what the runtimes keep of calls before (True: read again).
    """

    growth: float = GROWTH

    def __init__(self, leased: Callable[[], int], need: Callable[[str | None], int],
                 want: Callable[[str | None], int], margin: Callable[[int], int], *,
                 read: Callable[[], CgroupMemory | None] = read_cgroup,
                 trim: Callable[[], None] | None = None,
                 give_back: Callable[[], bool] = lambda: False) -> None:
        self._leased, self._need, self._want, self.margin = leased, need, want, margin
        self._read = read
        self._give_back = give_back
        self._trim = trim if trim is not None else trimmer()
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}     # ticket -> bytes it holds (estimated until decoded)
        self._held_total = 0
        self._unread: dict[int, int] = {}   # ticket -> its estimate, until read and decoded
        self._unread_total = 0
        self._refs: dict[int, int] = {}     # ticket -> holders (the request, its samples)
        self._next = 0
        self._idle: int | None = None
        self._rebased = 0.0
        self._admitted = self._busy = self._too_large = 0
        first = read()
        self.active = first is not None and first.limit is not None
        if self.active and trim is None:  # the process's own allocator (tests pass their own)
            map_large_blocks(LARGE_BLOCK)  # request bodies and samples
        if self.active and first is not None:
            self._idle = first.working_set  # read again once the models are loaded (rebase)

    def reading(self) -> CgroupMemory | None:
        """The group now, where a limit applies."""
        reading = self._read()
        return reading if reading is not None and reading.limit is not None else None

    @property
    def idle(self) -> int | None:
        """The working set when nothing is held (None: not read yet)."""
        return self._idle

    def move_idle(self, change: int) -> None:
        """What stays when nothing is held changed by ``change`` bytes (a model loaded or
        unloaded), known before it can be read again (requests are held now); ``rebase``
        reads it once it can."""
        with self._lock:
            if self._idle is not None:
                self._idle = max(0, self._idle + change)
        self.rebase()

    def rebase(self, force: bool = True) -> None:
        """Read the idle working set when nothing is held or leased (caller holds no lock),
        what the runtimes keep of calls before given back first: it is not what stays."""
        if not self.active:
            return
        now = time.monotonic()
        if not force and now - self._rebased < REBASE_S and self._idle is not None:
            return
        with self._lock:
            if self._held_total or self._leased():
                return
        self._give_back()
        self._trim()
        reading = self.reading()
        with self._lock:
            if reading is None or self._held_total or self._leased():
                return
            self._idle, self._rebased = reading.working_set, now

    def _capacity(self, reading: CgroupMemory) -> int:
        """Bytes under the limit for requests and plans together (idle use and margin out).
        With nothing held or leased, a reading below the idle working set read before is what
        stays now (what was freed since, the reading after a release having been skipped as
        too soon after the last): the lower is taken (caller holds the lock)."""
        if self._idle is None or (reading.working_set < self._idle and not self._held_total
                                  and not self._leased()):
            self._idle = reading.working_set  # the first reading: at start, nothing held yet
        assert reading.limit is not None
        return reading.limit - self._idle - self.margin(reading.limit)

    # ------------------------------------------------------------------ plans

    def plan_free(self, reading: CgroupMemory) -> int:
        """What plans may use now: the ledger's room less the reserve for arriving requests,
        never more than the group's headroom read now (the margin kept out of both). Where
        the headroom alone leaves plans less than their working bytes, what the runtimes keep
        is given back first and the group read again."""
        want = max(self._need(None), self._want(None))
        free, short = self._plan_free(reading, want)
        if short and self._give_back():
            again = self.reading()
            if again is not None:
                free, _ = self._plan_free(again, want)
        return free

    def _plan_free(self, reading: CgroupMemory, want: int) -> tuple[int, bool]:
        """(what plans may use, whether the group's headroom alone keeps it below ``want``)."""
        assert reading.limit is not None and reading.free is not None
        with self._lock:
            capacity = self._capacity(reading)
            room = capacity - self._held_total
            unread = self._unread_total
        # requests arriving meanwhile get a reserve, but not below the plans' working bytes
        reserve = max(0, min(capacity // RESERVE_SHARE, room - int(self.growth * want)))
        # the group now, less the bodies still coming in and a quarter of the margin for what
        # else is in flight (the ledger keeps all of it); the arbiter adds its live leases
        headroom = reading.free - unread - self.margin(reading.limit) // 4
        short = headroom < room - reserve and headroom < int(self.growth * want)
        return max(0, int(min(room - reserve, headroom) / self.growth)), short

    def ceiling(self, reading: CgroupMemory) -> int:
        """The most plans could get with nothing held: a one-sample plan larger than this
        can never run; one that fits waits for memory."""
        with self._lock:
            return max(0, int(self._capacity(reading) / self.growth))

    # ------------------------------------------------------------------ requests

    def admit(self, model: str | None, hold: int, what: str) -> Ticket | None:
        """A place now for a request that will hold about ``hold`` bytes, None when there is
        no room now; RequestTooLargeError when there never is. Where the ledger has room and
        only the group is short, what the runtimes keep is given back and the group read
        again."""
        ticket = self._admit(model, hold, what)
        if ticket is False:
            ticket = self._admit(model, hold, what) if self._give_back() else None
        return ticket or None

    def _admit(self, model: str | None, hold: int, what: str) -> Ticket | bool | None:
        """``admit`` on one reading: False where only the group's headroom keeps it out."""
        reading = self.reading()
        if reading is None:
            return Ticket(0, model)  # the limit was lifted meanwhile: nothing to count
        assert reading.limit is not None and reading.free is not None
        need = self._need(model)
        wanted = self._want(model)  # read outside the lock (the owner's tables)
        margin = self.margin(reading.limit)
        with self._lock:
            capacity = self._capacity(reading)
            need_grown = int(self.growth * need)
            if hold + need_grown > capacity:
                self._too_large += 1
                raise RequestTooLargeError(
                    f"body: {what} would hold about {hold} bytes and a one-sample plan of "
                    f"{model or 'the model'} needs {need} ({need_grown} as the group grows "
                    f"when it runs): {hold + need_grown} in all, more than the "
                    f"{max(0, capacity)} bytes the memory limit leaves ({reading.limit} bytes on "
                    f"cgroup {(reading.bound.path if reading.bound else reading.group)}, "
                    f"{self._idle} in use when idle, {margin} margin); send fewer samples per "
                    "request, or raise the memory limit")
            leased = self._leased()
            # what the plans keep beside it: their working bytes, or as much of them as this
            # request alone leaves under the limit (at least a one-sample plan)
            want = max(need, min(wanted, int((capacity - hold) / self.growth)))
            plans = int(self.growth * max(leased, want))
            # the ledger: what is held and leased, and this one, within the limit
            if self._held_total + hold + plans > capacity:
                return None
            # and the group as the kernel counts it now: what is not in it yet (bodies not
            # read, plans not allocated, a plan to run them) must fit in its headroom
            if self._unread_total + hold + plans > reading.free - margin:
                return False
            self._next += 1
            self._held[self._next] = hold
            self._unread[self._next] = hold
            self._held_total += hold
            self._unread_total += hold
            self._admitted += 1
            return Ticket(self._next, model)

    def refused_busy(self) -> str:
        """Count a request that waited for room in vain; what holds the memory, in words."""
        with self._lock:
            self._busy += 1
            held, requests = self._held_total, len(self._held)
        return (f"{held} bytes held by {requests} requests and {self._leased()} by running "
                "plans")

    def resize(self, ticket: Ticket | None, hold: int) -> None:
        """The request has been read and decoded and holds ``hold`` bytes (or what it was
        admitted for, if more: the pieces its body came in are freed, but the allocator keeps
        them for the next bodies) in the group as the kernel counts it: no longer unread."""
        if ticket is None:
            return
        with self._lock:
            old = self._held.get(ticket.token)
            if old is None:
                return
            hold = max(old, hold)
            self._held[ticket.token] = hold
            self._held_total += hold - old
            self._unread_total -= self._unread.pop(ticket.token, 0)

    def keep(self, ticket: Ticket | None, data: object) -> None:
        """What the request holds lives as long as ``data`` (its samples, which its batch
        keeps after a timeout answered it) too: released when both it and the request are
        done."""
        if ticket is None or not ticket.token:
            return
        with self._lock:
            if ticket.token not in self._held:
                return
            self._refs[ticket.token] = self._refs.get(ticket.token, 1) + 1
        weakref.finalize(data, self.release, ticket)

    def release(self, ticket: Ticket | None) -> None:
        """The request has been answered (or refused), or its samples are gone: what it held
        is free again once both are (``keep``)."""
        if ticket is None:
            return
        with self._lock:
            refs = self._refs.pop(ticket.token, 1) - 1
            if refs > 0:
                self._refs[ticket.token] = refs
                return
            hold = self._held.pop(ticket.token, None)
            if hold is None:
                return
            self._held_total -= hold
            self._unread_total -= self._unread.pop(ticket.token, 0)
            idle = not self._held_total
        if idle:
            self.rebase(force=False)

    def report(self, plans_may_use: int | None, configured_margin: int, *,
               counting: bool = True) -> LedgerReport:
        """The ledger now; ``counting`` False: the group as read, no limit applied here (the
        ledger does not count this device's requests)."""
        counting = counting and self.active
        reading = self.reading() if counting else self._read()
        bound = reading.bound if reading is not None else None
        limit = reading.limit if counting and reading is not None else None
        with self._lock:
            held, requests = self._held_total, len(self._held)
        return LedgerReport(
            limit_bytes=limit, limit_group=bound.path if bound is not None else None,
            cgroup_version=reading.version if reading is not None else None,
            working_set_bytes=reading.working_set if reading is not None else None,
            idle_working_set_bytes=self._idle if limit is not None else None,
            margin_bytes=self.margin(limit) if limit is not None else configured_margin,
            held_bytes=held, requests=requests, leased_bytes=int(self._leased()),
            plans_may_use_bytes=plans_may_use if limit is not None else None,
            admitted=self._admitted, refused_busy=self._busy,
            refused_too_large=self._too_large)
