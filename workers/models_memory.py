"""What loaded models keep, and whether a set of models fits: the device memory owner's part
for models (``DeviceMemory.models``).

Why here: which models fit beside each other, what one kept once loaded and what it gave back
unloaded are memory rules, and the device has one owner of memory. The service decides which
models to load (least recently used first out, ``service.residency``) and asks here whether
they fit; it never counts bytes itself. A set fits when what its models keep and the largest
one-sample plan among them (times the growth a plan causes in the group under a cgroup limit)
leave the reserve for requests' bodies in the capacity the models share; asked for a model
about to load, the plan stands beside what making its largest runtime session takes beyond
what it keeps, if more (``ModelCost.remaking``: the load makes its sessions). What a model keeps is
the larger of what its parts say (weights, sessions, batch buffer) and what the group grew by
while it loaded, where a cgroup limit is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.ledger import RESERVE_SHARE, Ticket

if TYPE_CHECKING:
    from workers.device_memory import DeviceMemory


@dataclass(frozen=True)
class ModelCost:
    """What a model takes loaded, as known before it loads."""

    name: str
    keeps: int        # weights, sessions and batch buffer: as measured or recorded, else weights
    one_sample: int   # its one-sample plan's bytes (0: no table known yet)
    working: int      # the bytes at which its batches run at working speed
    making: int = 0   # free while it makes its largest session (0: none, or not known yet)
    # of what it keeps, what ``making`` already counts: its sessions, which a runtime gives
    # back before it makes the largest again (the weights and the batch buffer stay); a torch
    # load's whole peak (making) counts all it keeps
    made: int = 0

    @property
    def remaking(self) -> int:
        """What making its largest session takes beyond what it keeps: the runtime asks
        ``making`` free beside what stays (``core.runtimes.ort_sessions``: the memory free
        and the sessions it may give back must hold it)."""
        return max(0, self.making - self.made)


@dataclass(frozen=True)
class Fit:
    """Whether a set of models fits the memory models may take, and by what figures."""

    kept: int        # what the models keep loaded
    plans: int       # the largest plan among them that must fit beside
    growth: float    # how many times its bytes a plan grows the group by
    reserve: int     # kept for requests' bodies (under a cgroup limit)
    capacity: int    # what the models may keep and their plans use, all together
    making: int = 0  # what the model about to load takes beyond what it keeps to make a session

    @property
    def need(self) -> int:
        """What they keep and the larger of their largest plan (as it grows the group) and
        the making of the loading model's largest session (the two never run at once: a
        model's thread makes its sessions as it loads)."""
        return self.kept + max(int(self.growth * self.plans), self.making)

    @property
    def fits(self) -> bool:
        return self.need + self.reserve <= self.capacity


@dataclass
class _Loads:
    """Loads that overlapped (each began before the others all ended): the group's growth
    over them is theirs together, not each one's."""

    start: int | None                 # the group's reading as the first began
    joined: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)

    @property
    def alone(self) -> bool:
        return len(self.joined) <= 1

    def join(self, name: str) -> None:
        self.joined.add(name)
        self.running.add(name)

    def leave(self, name: str) -> bool:
        """``name`` ended: whether it was the last one running."""
        self.running.discard(name)
        return not self.running


class ModelsMemory:
    """The loaded models' memory on one device (see the module doc)."""

    def __init__(self, owner: DeviceMemory) -> None:
        self._owner = owner
        self._kept: dict[str, int] = {}
        self._before: dict[str, int | None] = {}    # the group's reading as a load or unload began
        self._loads: dict[str, Ticket | None] = {}  # a load's place among requests' holds
        self._window: _Loads | None = None  # the loads under way, and those they overlapped

    def kept(self) -> dict[str, int]:
        """What each loaded model keeps."""
        return dict(self._kept)

    def kept_total(self) -> int:
        return sum(self._kept.values())

    def capacity(self) -> int:
        """What the loaded models may keep and their plans use, all together, now: the least
        of the configured total less the margin and, under a cgroup limit, the limit less the
        margin and what the process holds besides its models (the idle working set less what
        they keep), elsewhere what they keep plus the device's free memory less the margin."""
        owner = self._owner
        kept = self.kept_total()
        bounds = [owner.total - owner.margin()] if owner.total else []
        ledger = owner.ledger
        reading = ledger.reading() if ledger is not None else None
        if reading is not None and reading.limit is not None:
            idle = ledger.idle  # type: ignore[union-attr]
            besides = max(0, (idle if idle is not None else reading.working_set) - kept)
            bounds.append(reading.limit - owner.margin(reading.limit) - besides)
        else:
            bounds.append(kept + owner.probe.device_free() - owner.margin())
        return max(0, min(bounds))

    # ------------------------------------------------------------------ which fit

    def fit(self, models: Iterable[ModelCost], working: bool = False,
            loading: str | None = None) -> Fit:
        """Whether ``models`` fit loaded together: what each keeps (as counted for the loaded
        ones) and their largest one-sample plan (``working``: their working bytes, as at
        start, so that the models loaded then run near full speed); ``loading``: the model
        among them about to load, with room to make its largest session."""
        kept, total, plans, making = self._kept, 0, 0, 0
        for m in models:
            total += kept.get(m.name, m.keeps)
            plans = max(plans, max(m.working, m.one_sample) if working else m.one_sample)
            if m.name == loading:
                making = m.remaking
        capacity = self.capacity()
        reserve = capacity // RESERVE_SHARE if self._owner.counts_requests else 0
        return Fit(total, plans, self._owner.growth, reserve, capacity, making)

    def never_fits(self, model: ModelCost, loading: bool = False) -> str | None:
        """Why ``model`` can never be loaded, even alone, under a configured or cgroup limit,
        in words naming the figures and the fix (None: it can, or only the device's free
        memory bounds it, which may grow); ``loading``: with room to make its largest session
        as its load does."""
        owner = self._owner
        fit = self.fit([model], loading=model.name if loading else None)
        if not (owner.total or owner.counts_requests) or fit.fits:
            return None
        grown = f" ({fit.growth:g}x as the group grows when it runs)" if fit.growth != 1 else ""
        if owner.total and owner.total - owner.margin() <= fit.capacity:
            limit = (f"models_memory_bytes ({owner.total} bytes, less the {owner.margin()} "
                     "margin) allows")
            fix = "raise models_memory_bytes (VBS_MODELS_MEMORY_BYTES)"
        else:
            report = owner.report()
            limit = (f"the memory limit ({report.limit_bytes} bytes on cgroup "
                     f"{report.limit_group}, less its {report.margin_bytes} margin and what "
                     "the process holds besides its models) leaves")
            fix = "raise the memory limit"
        making = (f" (its load, making its largest session, takes {fit.making} beyond that)"
                  if fit.making > int(fit.growth * fit.plans) else "")
        return (f"keeps about {model.keeps} bytes loaded (weights, runtime sessions, its batch "
                f"buffer) and its one-sample plan needs {model.one_sample}{grown}{making}"
                + (f", with {fit.reserve} kept for requests" if fit.reserve else "")
                + f": {fit.need + fit.reserve} bytes in all, more than the {fit.capacity} "
                f"{limit}; {fix}, or serve it where more memory is")

    # ------------------------------------------------------------------ loads and unloads

    def admit_load(self, model: ModelCost) -> bool:
        """A place for ``model``'s load among what requests hold, for what it will keep
        (False: not now; ``RequestTooLargeError`` when never): counted as in the group at
        once (it is, as its weights are made), not as a body still to come, which the
        group's reading would count a second time. Held until ``loaded`` or ``load_ended``."""
        owner = self._owner
        ticket = owner.admit(model.name, model.keeps, f"loading model {model.name}")
        if ticket is None:
            return False
        owner.resize(ticket, model.keeps)
        self._loads[model.name] = ticket
        self._before[model.name] = owner.in_use()
        self._join(model.name)
        return True

    def loading(self, name: str) -> None:
        """``name`` starts loading without a place asked (at start): the group read now."""
        self._before.setdefault(name, self._owner.in_use())
        self._join(name)

    def loaded(self, name: str, parts: int) -> int:
        """``name`` is loaded and keeps what its parts say (``parts``: weights, sessions,
        batch buffer), or what the group grew by while it loaded where that is more and no
        other load overlapped it (else the group's growth over the overlapping loads, less
        what their parts say, is shared among them by their parts once the last one ends);
        counted from now until ``unloaded``; its load's place given back. What it keeps."""
        before, after = self._before.pop(name, None), self._owner.in_use()
        kept = max(0, int(parts))
        window = self._window
        if before is not None and after is not None and (window is None or window.alone):
            kept = max(kept, after - before)
        self._kept[name] = kept
        self._owner.idle_moved(kept)  # before its place goes: a reading then includes it
        self._end_load(name)
        self._leave(name)
        return self._kept[name]

    def load_ended(self, name: str) -> None:
        """``name``'s load is over, loaded or not: its place given back, if ``loaded`` has
        not given it back already."""
        self._before.pop(name, None)
        self._end_load(name)
        self._leave(name)

    def _join(self, name: str) -> None:
        """``name``'s load is under way: in the window of the loads that overlap."""
        if self._window is None:
            self._window = _Loads(start=self._owner.in_use())
        self._window.join(name)

    def _leave(self, name: str) -> None:
        """``name``'s load ended; where it was the last of overlapping loads, what the group
        grew by over them beyond what their parts say is shared among those still loaded."""
        window = self._window
        if window is None or not window.leave(name):
            return
        self._window = None
        now = self._owner.in_use()
        if window.alone or window.start is None or now is None:
            return
        loaded = {n: self._kept[n] for n in window.joined if n in self._kept}
        total = sum(loaded.values())
        excess = now - window.start - total
        if excess <= 0 or total <= 0:
            return
        for n, k in loaded.items():
            share = excess * k // total
            self._kept[n] += share
            self._owner.idle_moved(share)

    def _end_load(self, name: str) -> None:
        ticket = self._loads.pop(name, None)
        if ticket is not None:
            self._owner.done(ticket)

    def unloading(self, name: str) -> None:
        """``name`` is about to give back what it keeps: the group read now."""
        self._before[name] = self._owner.in_use()

    def unloaded(self, name: str) -> tuple[int, int]:
        """``name`` gave back what it kept: (what left the group, what it kept). Without a
        group to read, all it kept is taken as given back."""
        kept = self._kept.pop(name, 0)
        before, after = self._before.pop(name, None), self._owner.in_use()
        released = kept if before is None or after is None else min(kept, max(0, before - after))
        self._owner.idle_moved(-released)
        return released, kept


__all__ = ["Fit", "ModelCost", "ModelsMemory"]
