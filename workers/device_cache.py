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

Not every cached byte can be given back, or used by any block: ``empty_cache`` frees only
whole free segments and, with expandable segments (``core.cuda_allocator``), only the whole
pages inside free blocks. A CUDA graph's private pool serves only captures into it: its free
bytes are never free for plans, and a pool whose graphs are all gone (a runtime grown or
released while a caller held a graph) is the device's again only at the next ``empty_cache``
(a trim here, or a capture's), which gives back what it can. What is left (free bytes beside live tensors) fits only the blocks that fit
in it. ``cache_of`` sorts the allocator's own segments (``torch.cuda.memory_snapshot``) by
what they are good for.

The decisions are ``excess`` (pure) and ``IdleTrim`` (one thread that waits for the idle
moment); ``DeviceCache`` joins them to the allocator. On a CPU there is no such cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vbs.workers.device_cache")

MIN_SLACK = 32 * 2**20  # cached bytes beyond the plans' needs that are not worth a trim
SLACK_SHARE = 4         # ... or 1/SLACK_SHARE of what the plans need, whichever is more

# What an expandable segment maps and unmaps at a time (PyTorch's kSmallBuffer, kLargeBuffer)
SMALL_PAGE = 2 * 2**20   # the small pool's (blocks of 1 MiB or less)
LARGE_PAGE = 20 * 2**20  # the large pool's


@dataclass(frozen=True)
class Cache:
    """The allocator's cached, unused bytes on one device, by what they are good for."""

    releasable: int   # what empty_cache gives back: whole free segments, whole free pages
    reusable: int     # releasable, and the large pool's free blocks at the ends of mapped
    #                   ranges: a block of any size can start or end there (and map the rest)
    pools: int        # free in CUDA graphs' private pools, live or not: never plans' (a report)
    expandable: bool  # the allocator maps pages: the driver's free memory serves in pages


def _pages(start: int, size: int, origin: int, page: int) -> int:
    """The bytes of the whole pages (counted from ``origin``) inside [start, start + size)."""
    first = origin + -(-(start - origin) // page) * page
    last = origin + (start + size - origin) // page * page
    return max(0, last - first)


def cache_of(segments: Iterable[Mapping[str, Any]]) -> Cache:
    """Sort the segments of ``torch.cuda.memory_snapshot()`` (one device's) as the allocator
    treats them: ``release_cached_blocks`` frees a segment's block only when it is the whole
    segment, and on an expandable segment (reported as one segment per mapped range, which
    starts on a page) unmaps only the whole pages inside a free block; a private pool's
    blocks are freed only once its graphs are gone, and serve no other block before: none of
    them is releasable or reusable here. A mapped range's last block borders
    unmapped address space, and so does its first, but for the lowest range of its stream
    (taken to start the segment's address space)."""
    releasable = reusable = pools = 0
    expandable = False
    ranges: list[Mapping[str, Any]] = []
    for segment in segments:
        total = int(segment.get("total_size", 0))
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            pools += max(0, total - int(segment.get("allocated_size", 0)))
        elif segment.get("is_expandable", False):
            ranges.append(segment)
        elif segment.get("blocks") and all(b.get("state") == "inactive"
                                           for b in segment["blocks"]):
            releasable += total
            reusable += total
    lowest: dict[tuple[Any, bool], int] = {}
    for segment in ranges:
        key = (segment.get("stream"), segment.get("segment_type", "large") != "small")
        lowest[key] = min(lowest.get(key, 1 << 64), int(segment.get("address", 0)))
    for segment in ranges:
        expandable = True
        large = segment.get("segment_type", "large") != "small"
        page = LARGE_PAGE if large else SMALL_PAGE
        origin = start = int(segment.get("address", 0))
        blocks = list(segment.get("blocks", ()))
        ends = {len(blocks) - 1} if origin == lowest[(segment.get("stream"), large)] else \
            {0, len(blocks) - 1}
        for i, block in enumerate(blocks):
            size = int(block.get("size", 0))
            if block.get("state") == "inactive":
                whole = _pages(start, size, origin, page)
                releasable += whole
                reusable += size if large and i in ends else whole
            start += size
    return Cache(releasable, reusable, pools, expandable)


def allocator_cache(device: Any) -> Cache:
    """``cache_of`` the allocator's segments on ``device`` (a CUDA device) now."""
    import torch

    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cache_of(s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index)


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
        """What a trim would give back now (``Cache.releasable``): reserved less allocated
        counts free bytes beside live tensors and CUDA graphs' pools, which it cannot."""
        return allocator_cache(self.device).releasable

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
