"""Peak memory of labelled regions from the torch profiler's CPU memory events (pure).

With ``profile_memory=True`` every allocation and free is an instant event ``[memory]``
whose ``Total Allocated`` is a running total for the whole process (it carries over between
profiling sessions). The peak of a region is therefore

    max(Total Allocated over the region's events) − (first event's Total Allocated − its Bytes)

i.e. measured from what was allocated just before the region began. A region with no
memory event allocated nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def region_peaks(events: Iterable[Mapping[str, Any]], prefix: str) -> dict[str, int]:
    """Peak bytes allocated inside every ``record_function`` range whose name starts with prefix.

    ``events`` are Chrome-trace events as ``export_chrome_trace`` writes them.
    """
    ranges: list[tuple[float, float, str]] = []
    memory: list[tuple[float, int, int]] = []
    for e in events:
        name = str(e.get("name", ""))
        if name == "[memory]":
            args = e.get("args") or {}
            if int(args.get("Device Type", 0)) != 0:  # CPU allocations only
                continue
            memory.append((float(e["ts"]), int(args["Total Allocated"]), int(args["Bytes"])))
        elif name.startswith(prefix) and e.get("ph") == "X":
            start = float(e["ts"])
            ranges.append((start, start + float(e.get("dur", 0.0)), name))
    memory.sort()
    ranges.sort()
    peaks: dict[str, int] = {}
    i = 0
    for start, end, name in ranges:
        while i < len(memory) and memory[i][0] < start:
            i += 1
        j = i
        base: int | None = None
        top = 0
        while j < len(memory) and memory[j][0] <= end:
            total, delta = memory[j][1], memory[j][2]
            if base is None:
                base = total - delta
            top = max(top, total)
            j += 1
        peaks[name] = 0 if base is None else max(0, top - base)
    return peaks
