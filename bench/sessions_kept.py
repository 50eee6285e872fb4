"""What each ONNX Runtime session of a compiled model keeps once the worker without torch has
loaded it (the runs its table's plans at the top budget call, ``workers.worker.Worker``), beside
the weights all its sessions share and those a session packs and owns. A model's sessions
each pack their own copy of the weights they pack (an int8 QLinearConv's, a float32 Gemm's:
``core.runtimes.ort_weights``), so runs that overlap hold those weights once per run.
docs/benchmarks.md, section 13.

    .venv/bin/python bench/sessions_kept.py --store STORE mobilenet_v2-int8=mobilenet_v2 mobilenet_v2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.runtimes.base import RuntimeOptions  # noqa: E402
from core.runtimes.ort_sessions import start  # noqa: E402
from core.spec import ModelSpec  # noqa: E402
from planner.store.factory import open_store  # noqa: E402
from planner.stored import read_compiled  # noqa: E402
from workers.array_backend import ArrayModel  # noqa: E402
from workers.memory import MemoryProbe  # noqa: E402
from workers.worker import Worker  # noqa: E402

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="served names, ALIAS=NAME where planned so")
    ap.add_argument("--store", required=True)
    ap.add_argument("--solver", default="vbs")
    args = ap.parse_args()
    start()
    store = open_store(args.store)
    for entry in args.models:
        served, _, name = entry.partition("=")
        stored = read_compiled(store, served, ModelSpec(name or served), args.solver, "time",
                               weights_dir=tempfile.gettempdir())
        model = ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint)
        worker = Worker(model, stored.tables[args.solver], MemoryProbe("cpu"), name=served,
                        runtime_options=RuntimeOptions())
        print(f"{served}: keeps {worker.kept_bytes() / MiB:.1f} MiB (weights "
              f"{model.weights_bytes / MiB:.1f}, batch buffer {worker.buffer_bytes / MiB:.1f})")
        for name_, runtime in worker.runtimes.items():
            shared = getattr(runtime, "_weights", None)
            runs = getattr(runtime, "_runs", {})
            if shared is None:
                continue
            print(f"  {name_}: {len(runs)} sessions; weights shared by them "
                  f"{shared.held_bytes / MiB:.2f} MiB, packed ones (each session its own copy) "
                  f"{shared.packed_bytes / MiB:.2f} MiB once")
            for (first, last), run in runs.items():
                print(f"    {first}..{last}: {run.held / MiB:.2f} MiB")
        worker.release()
    store.close()


if __name__ == "__main__":
    main()
