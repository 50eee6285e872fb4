"""ONNX Runtime's workspace per unit and batch size: the peak resident memory of one run.

ONNX Runtime allocates outside torch, so torch's profiler cannot see it. Its workspace in a
unit (the activations between the unit's ops, its kernels' scratch, the blocked-layout
copies) is measured as the growth of the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) while the unit runs once, its input and output already
resident. That needs every allocation to be its own mapping, returned when freed, so it runs
in a child process with glibc's mmap threshold at one page and the session without its arena
(the memory pattern, one block for the activations inside, as served). Exact to the page per
allocation (one page), but what a call takes varies from call to call (how its threads split
the work and when each frees its scratch): in proportion on large units, and by a roughly
constant amount on small ones, in the same process and between processes. So the
workspace is the most of ``repeats`` calls plus ``MARGIN`` of it plus ``SLACK``, so that a
call does not take more than it says (tests/core/test_runtimes.py checks that in real
plans, in another process). Tensors smaller than a page come from the heap, where RSS cannot
see them: a unit that small is measured at what it touched.

    python -m core.runtimes.ort_memory JOB.json   # prints {name: {batch: bytes}}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from core.errors import ProfileError

MARGIN = 1 / 8
SLACK = 256 * 1024
# glibc: every allocation of a page or more its own mapping, returned to the system when freed
ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0",
       "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096:glibc.malloc.trim_threshold=0"}


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise ProfileError(f"/proc/self/status has no {key}: cannot measure ONNX Runtime's memory")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child(job_path: str) -> None:
    import numpy as np
    import onnxruntime as ort

    job = json.loads(Path(job_path).read_text())
    dtype = np.dtype(job["dtype"])
    options = ort.SessionOptions()  # as core.runtimes.onnxrt's, without the arena
    options.intra_op_num_threads = job["threads"]
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    out: dict[str, dict[str, int]] = {}
    for unit in job["units"]:
        session = ort.InferenceSession(unit["path"], options, providers=["CPUExecutionProvider"])
        peaks: dict[str, int] = {}
        for b in job["batches"]:
            x = np.random.default_rng(b).standard_normal((b, *unit["in"])).astype(dtype)
            y = np.ones((b, *unit["out"]), dtype=dtype)  # resident before the run
            binding = session.io_binding()
            binding.bind_input("x", "cpu", 0, dtype, x.shape, x.ctypes.data)
            binding.bind_output("y", "cpu", 0, dtype, y.shape, y.ctypes.data)
            session.run_with_iobinding(binding)  # first-run allocations are not the unit's need
            peak = 0
            for _ in range(job["repeats"]):
                base = status_bytes("VmRSS")
                reset_peak()
                session.run_with_iobinding(binding)
                peak = max(peak, status_bytes("VmHWM") - base)
            peaks[str(b)] = peak + int(peak * MARGIN) + SLACK
        out[unit["name"]] = peaks
        del session
    json.dump(out, sys.stdout)


def measure_workspaces(units: Iterable[tuple[str, bytes, tuple[int, ...], tuple[int, ...]]],
                       batches: list[int], dtype: str, threads: int, repeats: int = 5
                       ) -> dict[str, dict[int, int]]:
    """Peak bytes ONNX Runtime allocates running each unit ``(name, onnx bytes, per-sample
    input shape, per-sample output shape)`` once at every batch size, beyond its input and
    output."""
    with tempfile.TemporaryDirectory(prefix="vbs-ort-") as tmp:
        job_units = []
        for k, (name, blob, shape_in, shape_out) in enumerate(units):
            path = Path(tmp) / f"{k}.onnx"
            path.write_bytes(blob)
            job_units.append({"name": name, "path": str(path), "in": list(shape_in),
                              "out": list(shape_out)})
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"units": job_units, "batches": batches, "dtype": dtype,
                                   "threads": threads, "repeats": repeats}))
        done = subprocess.run([sys.executable, "-m", "core.runtimes.ort_memory", str(job)],
                              capture_output=True, text=True, env={**os.environ, **ENV})
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ProfileError(f"measuring ONNX Runtime's workspaces failed: {tail[0]}")
    raw = json.loads(done.stdout)
    return {name: {int(b): int(v) for b, v in per.items()} for name, per in raw.items()}


if __name__ == "__main__":
    _child(sys.argv[1])
