"""A served model's call as the worker without torch makes it, against one ONNX Runtime session
of the same model as one file (``bench/int8_export.py``'s, what Triton ran), per request size,
interleaved rounds: whether a served difference is in the call or around it.

    .venv/bin/python bench/int8_call.py --store ~/.cache/vbs-serve/peers-store \\
        --served resnet50-int8 --model resnet50 --onnx /tmp/vp/resnet50-int8.onnx [--batch 1,4,8]
        [--rounds 7] [--keep-spinning]

Both spin their threads while a call runs and stop them when it returns, as vbs-serve's
sessions do; ``--keep-spinning`` lets the plain session's threads spin on after its call (ONNX
Runtime's default), which slows the worker's next call on the same cores: a trap for any probe
of two sessions in one process (docs/benchmarks.md, section 13).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.runtimes.ort_arrays import cpu_threads  # noqa: E402
from core.runtimes.ort_sessions import SPIN, STOP, start  # noqa: E402
from int8_export import read_served, served_arguments  # noqa: E402
from workers.array_backend import ArrayModel  # noqa: E402
from workers.memory import MemoryProbe  # noqa: E402
from workers.worker import Worker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    served_arguments(ap)
    ap.add_argument("--onnx", required=True, type=Path)
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--keep-spinning", action="store_true")
    args = ap.parse_args()
    start()
    stored = read_served(args, weights_dir=tempfile.gettempdir())
    worker = Worker(ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint),
                    stored.tables["vbs"], MemoryProbe("cpu"), name=args.served)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = cpu_threads(), 1
    options.add_session_config_entry(SPIN, "1")
    options.add_session_config_entry(STOP, "0" if args.keep_spinning else "1")
    plain = ort.InferenceSession(str(args.onnx), options, providers=["CPUExecutionProvider"])
    name = plain.get_inputs()[0].name
    try:
        for b in (int(v) for v in args.batch.split(",")):
            x = np.random.default_rng(b).standard_normal((b, *plain.get_inputs()[0].shape[1:]),
                                                          dtype=np.float32)
            y, info = worker.infer(x)
            diff = float(np.abs(np.asarray(y) - plain.run(None, {name: x})[0]).max())
            times: dict[str, list[float]] = {"worker": [], "plain": []}
            calls = {"worker": lambda: worker.infer(x), "plain": lambda: plain.run(None, {name: x})}
            for _ in range(args.rounds):
                for who, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    times[who].append(time.perf_counter() - t0)
            w, p = (1e3 * statistics.median(times[k]) for k in ("worker", "plain"))
            pieces = " + ".join(str(c.batch) for c in info.choices)
            calls_of = sum(len(c.runs) for c in info.choices)
            print(f"{b} samples: worker {w:.1f} ms ({pieces}, {calls_of} runtime calls), one "
                  f"session {p:.1f} ms, the worker at {p / w:.2f}x its speed; largest "
                  f"difference {diff:.3g}", flush=True)
    finally:
        worker.release()


if __name__ == "__main__":
    main()
