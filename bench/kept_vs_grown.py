"""What the worker without torch says a model keeps against what its process really grew by,
both after glibc's free pages went back to the kernel (docs/benchmarks.md, section 13).

    .venv/bin/python bench/kept_vs_grown.py --store DIR SERVED=MODEL [SERVED=MODEL ...]

Each model in a fresh process of its own (as `vbs plan`'s load measurement): ONNX Runtime set
up, the heap trimmed, then the compiled model loaded as a worker loads it (its sessions for the
plans at the top budget made) and the heap trimmed again: ``Worker.kept_bytes`` beside the
growth of the process's resident set.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 2**20


def _one(store_at: str, served: str, name: str) -> None:
    from core.malloc import trimmer
    from core.runtimes.ort_memory import status_bytes
    from core.runtimes.ort_sessions import start
    from core.spec import ModelSpec
    from planner.store import open_store
    from planner.stored import read_compiled
    from workers.array_backend import ArrayModel
    from workers.memory import MemoryProbe
    from workers.worker import Worker

    start()
    trim = trimmer()
    trim()
    store = open_store(store_at)
    before = status_bytes("VmRSS")
    stored = read_compiled(store, served, ModelSpec(name), "vbs", "time",
                           weights_dir=tempfile.gettempdir())
    model = ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint)
    worker = Worker(model, stored.tables["vbs"], MemoryProbe("cpu"), name=served)
    trim()
    print(f"{served}: kept {worker.kept_bytes() / MiB:.1f} MiB, the process grew "
          f"{(status_bytes('VmRSS') - before) / MiB:.1f} MiB", flush=True)
    worker.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="SERVED=MODEL (or MODEL when they are one)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child's run
    args = ap.parse_args()
    if args.one:
        served, _, name = args.models[0].partition("=")
        _one(args.store, served, name or served)
        return
    for entry in args.models:
        subprocess.run([sys.executable, __file__, "--store", args.store, "--one", entry],
                       check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
