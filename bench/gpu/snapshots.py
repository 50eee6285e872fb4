"""The caching allocator's own segments at three moments of a served plan, as fixtures for the
device-cache tests (``workers.device_cache.cache_of`` reads them): after a plan ran, after a
second process took the device's free memory, and after a plan ran under it.

    python -m bench.gpu.snapshots --device cuda --store DIR --model resnet50 --batch 16 \
        --memory-limit BYTES --margin BYTES --leave BYTES --out snapshots.json

The serve step runs it after its served runs (no endpoint of the service dumps them): the same
code as `vbs serve` (``workers.device_memory.DeviceMemory``, ``workers.worker.Worker``, the
stored table, the allocator set as the service sets it), bench/memory_hog.py beside it. Each
dump keeps the segments' fields ``cache_of`` reads (no frames, no history), with what the
driver, the allocator, ``cache_of``, ``cuda_free`` and the probe said then. On the CPU it reads
the table and stops before the model with a ``CUDA only:`` reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
SEGMENT = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
           "stream", "segment_type", "segment_pool_id", "is_expandable")
BLOCK = ("address", "size", "requested_size", "state")


def trim(segments: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot()``'s segments with only what ``cache_of`` and a reader of
    the layout need: no frames, no history."""
    out = []
    for segment in segments:
        kept = {k: segment[k] for k in SEGMENT if k in segment}
        if "segment_pool_id" in kept:
            kept["segment_pool_id"] = list(kept["segment_pool_id"])
        kept["blocks"] = [{k: b[k] for k in BLOCK if k in b} for b in segment.get("blocks", ())]
        out.append(kept)
    return out


def dump(name: str, after: str, memory: Any, info: Any = None) -> dict[str, Any]:
    """One moment: the trimmed segments and every reading of them."""
    import torch

    from workers.device_cache import cache_of
    from workers.memory import cuda_free

    torch.cuda.synchronize()
    segments = trim(torch.cuda.memory_snapshot())
    free, total = torch.cuda.mem_get_info()
    return {"name": name, "after": after, "mem_get_info": [int(free), int(total)],
            "reserved": int(torch.cuda.memory_reserved()),
            "allocated": int(torch.cuda.memory_allocated()),
            "cache_of": asdict(cache_of(segments)), "cuda_free": cuda_free("cuda"),
            "probe_free": memory.probe.free(), "plan_free": memory.plan_free(),
            "plans": [int(c.peak_bytes) for c in info.choices] if info is not None else [],
            "segments": segments}


def _hog(leave: int, ready: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / "memory_hog.py"), "--device",
                             "cuda", "--leave-steps", str(leave), "--hold-s", "120", "--ready",
                             str(ready)], cwd=ROOT, stdout=subprocess.DEVNULL)


def _moments(args: argparse.Namespace, cap: Any, table: Any) -> list[dict[str, Any]]:
    """The plan, the hog's take (the service's cache still covering what the plan used), the
    plan under it once the cache was given back (as the idle thread gives it: here at once)."""
    from workers.device_memory import DeviceMemory
    from workers.memory import release_cached
    from workers.worker import Worker

    name = cap.model.spec.name
    memory = DeviceMemory("cuda", limit=args.memory_limit, margin=args.margin, cache_idle_s=0)
    ready = Path(args.out).with_suffix(".ready")
    ready.unlink(missing_ok=True)
    hog = None
    try:
        memory.register(name, lambda: table, lambda: 0)
        worker = Worker(cap, table, memory.probe, name=name, memory=memory)
        x = cap.model.example(args.batch, seed=1)
        release_cached("cuda")
        _, info = worker.infer(x)
        dumps = [dump("plan", f"a plan of {args.batch} samples ran", memory, info)]
        hog = _hog(args.leave, ready)
        t0 = time.monotonic()
        while not ready.exists() and hog.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        dumps.append(dump("hog", f"another process took all free memory but {args.leave} "
                          "bytes; the service's cache as the plan left it", memory))
        memory.cache.trim()  # what the idle thread does once the device idled idle_s
        _, info = worker.infer(x)
        dumps.append(dump("hog-plan", "the cache given back (as after an idle spell), then a "
                          "plan ran in what the other process left", memory, info))
        return dumps
    finally:
        if hog is not None:
            hog.terminate()
            hog.wait(10)
        memory.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.snapshots",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", required=True, help="as vbs serve --model takes it")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--solver", default="vbs")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--memory-limit", type=int, required=True)
    parser.add_argument("--margin", type=int, default=0)
    parser.add_argument("--leave", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    from bench.gpu.step_serve import tables_of
    from core.loaded import ModelSpec

    name, _, shape = args.model.partition("@")
    table = tables_of(Path(args.store), name)[args.solver]
    out: dict[str, Any] = {"model": args.model, "solver": args.solver, "batch": args.batch,
                           "memory_limit": args.memory_limit, "margin": args.margin,
                           "dumps": [], "skipped": ""}
    if args.device != "cuda" or not torch.cuda.is_available():
        out["skipped"] = "CUDA only: torch.cuda.memory_snapshot"
    else:
        from planner.graph.capture import capture
        from planner.models import load_model
        from workers.device_cache import LARGE_PAGE

        spec = ModelSpec(name, input_shape=tuple(int(d) for d in shape.split("x")) if shape
                         else None, dtype=args.dtype, device="cuda")
        cap = capture(load_model(spec))
        out.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
                   large_page=LARGE_PAGE, dumps=_moments(args, cap, table))
    args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
