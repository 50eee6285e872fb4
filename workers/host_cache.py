"""What ONNX Runtime's arena keeps of the calls before, on a CPU under a memory limit: kept
while plans run, given back at rest and when memory is short.

Why: the one arena every session shares (``core.runtimes.ort_sessions``) keeps the blocks a
call used, so the next call reuses pages already faulted in; given back after every call, each
call maps and faults its activations in again, which cost the model's threads about a third
more CPU time here (docs/benchmarks.md, section 11). Under a cgroup limit what the arena
keeps is used memory to the group's reading, which requests are admitted and plans sized by.
So it is kept while plans run, and given back (``give_back``: the runtimes' hooks, ONNX
Runtime's arena shrinkage) when the device has been at rest ``idle_s`` (then the ledger reads
what stays), and when a request or a plan finds the group short (the ledger asks, then reads
again). The CPU's counterpart of ``workers.device_cache`` on CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from workers.device_cache import IdleTrim


class HostCache:
    """The runtimes' kept host memory on one CPU device (see the module doc): ``register``
    the runtimes' give-back hooks; ``busy()`` when a lease is taken, ``used()`` when one is
    returned, ``idle()`` when none is left; ``give_back()`` when memory is short. ``rested``
    is called after a give-back at rest (the ledger reads what stays)."""

    def __init__(self, idle_s: float, rested: Callable[[], None] = lambda: None) -> None:
        self._hooks: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self._used = False  # a plan ran since the last give-back: the arena may keep its blocks
        self._rested = rested
        self.given_back = 0  # how often (at rest and when short)
        self._idle = IdleTrim(self._at_rest, idle_s) if idle_s > 0 else None

    def register(self, give_back: Callable[[], object]) -> None:
        """A runtime's hook that gives back what it keeps (called from any thread)."""
        with self._lock:
            if give_back not in self._hooks:
                self._hooks.append(give_back)

    def unregister(self, give_back: Callable[[], object]) -> None:
        """A runtime released: its hook no longer called (nor kept)."""
        with self._lock:
            if give_back in self._hooks:
                self._hooks.remove(give_back)

    def busy(self) -> None:
        if self._idle is not None:
            self._idle.busy()

    def used(self) -> None:
        """A plan ran: its runtimes may keep what it used."""
        self._used = True

    def idle(self) -> None:
        if self._idle is not None:
            self._idle.idle()

    def give_back(self) -> bool:
        """Give back what the runtimes keep, where a plan ran since the last time: True when
        something may have been given back (read the memory again), False when there was
        nothing to give."""
        with self._lock:
            if not self._used or not self._hooks:
                return False
            self._used = False
            hooks = list(self._hooks)
        for hook in hooks:
            hook()
        self.given_back += 1
        return True

    def _at_rest(self) -> None:
        if self.give_back():
            self._rested()

    def close(self) -> None:
        if self._idle is not None:
            self._idle.close()
