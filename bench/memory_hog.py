"""A second process that takes and frees memory while `vbs serve` runs (`make gpu`, step serve).

    python bench/memory_hog.py --device cuda --leave 2GiB,1GiB,512MiB --hold-s 1 --gap-s 1 \
        --duration-s 40 [--delay-s 5] [--out hog.json]
    python bench/memory_hog.py --device cuda --leave-steps 48MiB,88MiB,128MiB --hold-s 3 \
        [--lead-s 2] [--ready held.flag] [--out hog.json]
    python bench/memory_hog.py --device cpu --take 128MiB,64MiB --memory-limit 128MiB ...

A service that plans for the memory free now is only tested when something else takes memory
while it serves. Cycles (``--leave``, ``--take``): each takes the next size of a list, holds it
``--hold-s``, gives it back and waits ``--gap-s``. On CUDA, ``--leave S`` takes everything the
device has free but S, ``--take S`` exactly S; the memory goes back to the driver
(``empty_cache``: the caching allocator would keep it). Steps (``--leave-steps``,
``--take-steps``): take once, then every ``--hold-s`` give part back, down to what the next
step holds, then all: a service whose cache was given back before the first take sees its
reading rise step by step (its own cache covers what it reached, so a take after a give-back
would not move it: bench/gpu/reach.py). ``--ready`` names a file written once the first take
holds. On the CPU it allocates and touches host memory, never more than ``--memory-limit``; no
cgroup joins it to the service's there, so this exercises the hog, not the step-down. The
report (JSON, also on SIGTERM): every cycle's or step's size and what failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.sizes import parse_bytes  # noqa: E402 - light: no torch, no numba

MiB = 2**20


class Hog:
    """Takes and frees memory of one device, cycle after cycle, until stopped."""

    def __init__(self, device: str, mode: str, sizes: list[int], limit: int) -> None:
        self.device, self.mode, self.sizes, self.limit = device, mode, sizes, limit
        self.schedule = "cycles"  # or "steps"
        self.cycles: list[dict[str, Any]] = []
        self.stop = threading.Event()
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("memory_hog: --device cuda, but torch sees no CUDA device")
            torch.cuda.init()

    def _free(self) -> int | None:
        if self.device != "cuda":
            return None
        import torch

        return int(torch.cuda.mem_get_info()[0])

    def _take(self, size: int, exact: bool = False) -> tuple[Any, int, str]:
        """(what holds the memory, bytes taken, error or ""); ``exact``: ``size`` bytes, not
        all free but ``size``."""
        if self.device != "cuda":
            import numpy as np

            n = min(size, self.limit) if self.limit else size
            return np.ones(n, dtype=np.uint8), n, ""  # touched: the pages are really taken
        import torch

        free = self._free() or 0
        want = max(0, free - size) if self.mode == "leave" and not exact else size
        if self.limit:
            want = min(want, self.limit)
        error = ""
        for _ in range(8):  # what is free moves while we take it (the service allocates too)
            if want <= 0:
                return None, 0, error
            try:
                return torch.empty(want, dtype=torch.uint8, device="cuda"), want, error
            except torch.OutOfMemoryError as exc:
                error = str(exc).splitlines()[0][:200]
                want -= 64 * MiB
        return None, 0, error

    def _give_back(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def run(self, duration_s: float, hold_s: float, gap_s: float, ready: Path | None = None
            ) -> None:
        end = time.monotonic() + duration_s
        k = 0
        while not self.stop.is_set() and time.monotonic() < end:
            size = self.sizes[k % len(self.sizes)]
            k += 1
            t0 = time.monotonic()
            held, taken, error = self._take(size)
            free_held = self._free()
            if ready is not None and k == 1:
                ready.write_text(str(t0))
            self.stop.wait(hold_s)
            del held
            self._give_back()
            self.cycles.append({"t": round(t0, 3), "size": size, "taken": taken,
                                "free_while_held": free_held, "error": error})
            self.stop.wait(gap_s)

    def _holds(self) -> list[int]:
        """What each step holds: all free but each level (leave), or each size (take); never
        more than the limit, never more than the step before."""
        if self.mode == "leave":
            free = self._free() or 0
            held = [max(0, free - level) for level in self.sizes]
        else:
            held = list(self.sizes)
        if self.limit:
            held = [min(h, self.limit) for h in held]
        return [min(held[:i + 1]) for i in range(len(held))]

    def steps(self, hold_s: float, lead_s: float = 0.0, ready: Path | None = None) -> None:
        """Take what the first step holds, in pieces, then give back one piece a step (the
        first step held ``lead_s`` longer: the load starts in it), then everything."""
        holds = self._holds()
        pieces: list[tuple[Any, int]] = []
        error = ""
        wanted = [holds[-1]] + [a - b for a, b in zip(reversed(holds[:-1]), reversed(holds[1:]))]
        for size in wanted:  # the last step's first: the pieces go back from the end
            held, taken, err = self._take(size, exact=True) if size else (None, 0, "")
            pieces.append((held, taken))
            error = error or err
        if ready is not None:
            ready.write_text(str(time.monotonic()))
        for i in range(len(holds)):
            self.cycles.append({"t": round(time.monotonic(), 3), "step": i, "size": self.sizes[i],
                                "taken": sum(t for _, t in pieces),
                                "free_while_held": self._free(), "error": error if i == 0 else ""})
            if self.stop.wait(hold_s + (lead_s if i == 0 else 0.0)):
                break
            if i + 1 < len(holds):
                pieces.pop()
                self._give_back()
        pieces.clear()
        self._give_back()
        self.cycles.append({"t": round(time.monotonic(), 3), "step": len(holds), "size": None,
                            "taken": 0, "free_while_held": self._free(), "error": ""})

    def report(self) -> dict[str, Any]:
        taken = [c["taken"] for c in self.cycles]
        return {"device": self.device, "mode": self.mode, "sizes": self.sizes, "limit": self.limit,
                "schedule": self.schedule,
                "cycles": len(self.cycles), "max_taken": max(taken, default=0),
                "min_taken": min(taken, default=0),
                "failed_takes": sum(1 for c in self.cycles if c["error"]),
                "min_free_while_held": min((c["free_while_held"] for c in self.cycles
                                            if c["free_while_held"] is not None), default=None),
                "log": self.cycles}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    sizes = parser.add_mutually_exclusive_group(required=True)
    sizes.add_argument("--leave", help="CUDA: take all free memory but these sizes, in turn")
    sizes.add_argument("--take", help="take these sizes, in turn (e.g. 128MiB,64MiB)")
    sizes.add_argument("--leave-steps", help="CUDA: take all free memory but the first size, "
                       "then give back up to each next size (ascending), then all")
    sizes.add_argument("--take-steps", help="take the first size, then give back down to each "
                       "next size (descending), then all")
    parser.add_argument("--memory-limit", default="0", help="most taken at once (0: no cap)")
    parser.add_argument("--hold-s", type=float, default=1.0)
    parser.add_argument("--gap-s", type=float, default=1.0)
    parser.add_argument("--lead-s", type=float, default=0.0, help="steps: the first held longer")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait before the first cycle")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--ready", type=Path, help="written once the first take holds")
    parser.add_argument("--out", type=Path, help="write the report here (else stdout)")
    args = parser.parse_args(argv)
    if (args.leave or args.leave_steps) and args.device != "cuda":
        parser.error("--leave needs --device cuda (on the CPU give --take and --memory-limit)")
    text = args.leave or args.take or args.leave_steps or args.take_steps
    mode = "leave" if args.leave or args.leave_steps else "take"
    try:
        sizes_ = [parse_bytes(s) for s in text.split(",") if s.strip()]
        limit = parse_bytes(args.memory_limit)
    except Exception as exc:  # noqa: BLE001 - one line for a bad size
        parser.error(str(exc))
    if args.device == "cpu" and not limit:
        parser.error("--device cpu needs --memory-limit: this machine is shared")
    hog = Hog(args.device, mode, sizes_, limit)
    signal.signal(signal.SIGTERM, lambda *_: hog.stop.set())
    signal.signal(signal.SIGINT, lambda *_: hog.stop.set())
    if not hog.stop.wait(args.delay_s):
        if args.leave_steps or args.take_steps:
            hog.schedule = "steps"
            hog.steps(args.hold_s, args.lead_s, args.ready)
        else:
            hog.run(args.duration_s, args.hold_s, args.gap_s, args.ready)
    text = json.dumps(hog.report(), indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
