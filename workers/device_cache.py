"""What PyTorch's caching allocator keeps on a CUDA device after plans have run, given back.

The allocator keeps the blocks a plan freed, so the next plan of that size does not wait for
``cudaMalloc``. The probe counts those blocks as free for this service's plans (they are), but
a neighbour on the same device can never take them: kept forever, they would pin the service's
reading at its largest plan and the step-down path would never run. So the blocks are given
back (``torch.cuda.empty_cache``) when plans no longer use them: when a smaller plan than the
last one finishes and it, with the leases still live, needs less than is cached by more than a
slack, and when the device has been idle (no lease) for ``idle_s``. A plan of the same size
run again never trims (no ``cudaMalloc`` for each batch). What remains cached is
then what this service holds for its own plans; the rest the driver reports free to everyone.

The decisions are ``excess`` (pure) and ``IdleTrim`` (one thread that waits for the idle
moment); ``DeviceCache`` joins them to the allocator. On a CPU there is no such cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("vbs.workers.device_cache")

MIN_SLACK = 32 * 2**20  # cached bytes beyond the plans' needs that are not worth a trim
SLACK_SHARE = 4         # ... or 1/SLACK_SHARE of what the plans need, whichever is more


def excess(unused: int, wanted: int) -> int:
    """Cached-but-unused bytes beyond what live plans want, worth giving back (0: keep them):
    more than ``MIN_SLACK`` or a quarter of ``wanted`` beyond it."""
    over = unused - wanted
    return over if over > max(MIN_SLACK, wanted // SLACK_SHARE) else 0


class IdleTrim:
    """Calls ``trim`` once the device has been idle ``idle_s`` seconds (``idle()`` then no
    ``busy()``), from one daemon thread; at most once per idle spell."""

    def __init__(self, trim: Callable[[], None], idle_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._trim = trim
        self._clock = clock
        self._cond = threading.Condition()
        self._idle_since: float | None = None  # None: busy, or trimmed already this spell
        self._closed = False
        self.trims = 0
        self._thread = threading.Thread(target=self._run, name="vbs-device-cache", daemon=True)
        self._thread.start()

    def busy(self) -> None:
        with self._cond:
            self._idle_since = None

    def idle(self) -> None:
        with self._cond:
            self._idle_since = self._clock()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._idle_since is None:
                    self._cond.wait()
                    continue
                left = self._idle_since + self.idle_s - self._clock()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._idle_since = None
                try:
                    self._trim()
                    self.trims += 1
                except Exception:  # noqa: BLE001 - a trim that fails leaves the cache as it was
                    log.exception("giving the device's cached memory back failed")


class DeviceCache:
    """The caching allocator of one CUDA device (see the module doc): ``done(wanted)`` after a
    plan's lease is returned, ``busy()``/``idle()`` as the device's leases come and go."""

    def __init__(self, device: str, idle_s: float) -> None:
        import torch

        self.device = torch.device(device)
        self.trims = 0  # after a smaller plan (the idle ones are ``IdleTrim.trims``)
        self._last_wanted = 0
        self._idle = IdleTrim(self.trim, idle_s) if idle_s > 0 else None

    def unused(self) -> int:
        import torch

        return max(0, torch.cuda.memory_reserved(self.device)
                   - torch.cuda.memory_allocated(self.device))

    def trim(self) -> None:
        import torch

        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

    def done(self, wanted: int) -> None:
        """A plan's lease was returned; ``wanted``: what the plans still running, and the one
        just done (the next is likely its size), need. Gives back the cache beyond it when
        that is less than the last time."""
        smaller, self._last_wanted = wanted < self._last_wanted, wanted
        if smaller and excess(self.unused(), wanted):
            self.trim()
            self.trims += 1

    def busy(self) -> None:
        if self._idle is not None:
            self._idle.busy()

    def idle(self) -> None:
        if self._idle is not None:
            self._idle.idle()

    @property
    def idle_trims(self) -> int:
        return self._idle.trims if self._idle is not None else 0

    def close(self) -> None:
        if self._idle is not None:
            self._idle.close()
