"""What a compiled model costs loaded, measured when `vbs plan` compiles it and kept in the store.

Before a model is first loaded, the service's memory owner must know what it will keep, or a
start with several models loads more than fits and then unloads the hottest: its weights alone
are low by 4-27x (sessions, the batch buffer). So `vbs plan` loads the compiled model once as a
worker without torch does (its tables read from the store, its runtimes' sessions made for the
plans at the top budget, ``workers.worker.Worker``), in a fresh process of its own (no torch, no
heap left over from profiling: what a worker's process grows by), and stores what the worker
says it keeps, how long that took and what making its sessions cost at their peak, per byte of
their weights (``core.runtimes.ort_sessions.served_factor``: what a session then asks free,
where the bound of 7 made resnet34 wait for memory it never needed). The service reads the
figures for a model it has not loaded yet (``service.loading``). Once a model has loaded, its
own figures replace them.

A model whose plans need torch is served with it even by the default worker, which then
imports torch into a process that had none: about 500 MiB for torch and 160 for torchvision
(the CUDA build), which killed a server of eight models at its limit as the ninth import did
not show in any model's cost. So for such a model `vbs plan` stores what the torch worker
keeps of it with that import counted, and the load's peak (``_measure_torch``): measured in a
fresh process of the worker without torch, as the lean worker's own process.

    python -m workers.load_cost < JOB.json   # what measure_load runs; prints the figures
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from core import errors
from core.errors import TableFormatError, TableNotFoundError, VbsError
from core.runtimes.base import RuntimeOptions
from core.runtimes.ort_memory import reset_peak, status_bytes
from core.runtimes.ort_sessions import SESSION_GROWTH, served_factor, start
from core.spec import ModelSpec
from planner.store import PlanStore
from planner.stored import read_compiled
from workers.array_backend import ArrayModel
from workers.memory import MemoryProbe
from workers.worker import Worker


@dataclass(frozen=True)
class LoadCost:
    """A compiled model loaded by a worker without torch: bytes it keeps, seconds it took."""

    kept_bytes: int
    load_s: float
    weights_bytes: int  # of ``kept_bytes``
    held_bytes: int     # of ``kept_bytes``: its runtimes' sessions
    making_bytes: int   # free while its largest session is made (``Worker.making_bytes``)
    making_factor: float = float(SESSION_GROWTH)  # what a session asks free per weight byte
    making_seen: float = 0.0  # what making its sessions took per weight byte, measured
    with_torch: bool = False  # served with torch: ``kept_bytes`` counts torch's import
    buffer_bytes: int = 0  # of ``kept_bytes``: the batch buffer (``Worker.buffer_bytes``)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "LoadCost":
        try:
            raw = json.loads(data)
            cost = cls(kept_bytes=int(raw["kept_bytes"]), load_s=float(raw["load_s"]),
                       weights_bytes=int(raw["weights_bytes"]), held_bytes=int(raw["held_bytes"]),
                       making_bytes=int(raw["making_bytes"]),
                       # figures of a `vbs plan` that did not measure it: the bound
                       making_factor=float(raw.get("making_factor", SESSION_GROWTH)),
                       making_seen=float(raw.get("making_seen", 0.0)),
                       with_torch=bool(raw.get("with_torch", False)),
                       buffer_bytes=int(raw.get("buffer_bytes", 0)))
        except (ValueError, TypeError, KeyError) as exc:
            raise TableFormatError(f"{where} cannot be read ({exc!r}): run `vbs plan` for the "
                                   "model again") from exc
        if min(cost.kept_bytes, cost.weights_bytes, cost.held_bytes, cost.making_bytes,
               cost.buffer_bytes) < 0 \
                or cost.load_s < 0 or cost.making_seen < 0 \
                or not 0 < cost.making_factor <= SESSION_GROWTH:
            raise TableFormatError(f"{where} holds figures out of range (negative, or a session "
                                   f"factor above {SESSION_GROWTH}): run `vbs plan` again")
        return cost


def measure_load(location: str, served: str, spec: ModelSpec, solver: str, objective: str,
                 options: RuntimeOptions | None = None, *,
                 torch_settings: dict[str, Any] | None = None) -> tuple[str, LoadCost]:
    """Load ``served``'s compiled model from the store at ``location`` as a worker without
    torch does, in a fresh process (``_measure_here``), and measure it; (its compiled id, the
    figures). With ``torch_settings`` (the planner's settings given on the command line, and
    ``batch_max`` and ``grid``: the profile's fingerprint), the torch worker's load instead,
    torch's import included (``_measure_torch``). Errors of the load come back as the same
    ``core.errors`` class."""
    options = options or RuntimeOptions()
    job = {"location": location, "served": served, "solver": solver, "objective": objective,
           "spec": {"name": spec.name, "dtype": spec.dtype, "device": spec.device,
                    "input_shape": list(spec.input_shape) if spec.input_shape else None,
                    "weights": str(spec.weights) if spec.weights else None},
           "options": {"spin": options.spin, "max_sessions": options.max_sessions,
                       "arena": options.arena}, "torch": torch_settings}
    root = Path(__file__).resolve().parent.parent  # the job names the store, not argv (its password)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-m", "workers.load_cost"], input=json.dumps(job),
                          capture_output=True, text=True, env=env, cwd=root)
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise VbsError(f"measuring what {served} keeps loaded failed (exit {done.returncode}): "
                       f"{done.stderr.strip()[-800:]}") from None
    if "error" in out:
        kind = getattr(errors, out["error"], VbsError)
        raise (kind if isinstance(kind, type) and issubclass(kind, VbsError) else VbsError)(
            out["message"])
    return out["compiled_id"], LoadCost.from_bytes(json.dumps(out["cost"]).encode(),
                                                    f"what measuring {served} printed")


def _measure_here(store: PlanStore, served: str, spec: ModelSpec, solver: str, objective: str,
                  options: RuntimeOptions) -> tuple[str, LoadCost]:
    """``measure_load``'s work, in this process; what it made is given back before returning."""
    start()  # ONNX Runtime's set-up of the process: once a process, not a session's making
    t0 = time.perf_counter()
    # its weights apart as a worker keeps them (``service.loading``)
    stored = read_compiled(store, served, spec, solver, objective,
                           weights_dir=tempfile.gettempdir())
    model = ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint)
    worker = Worker(model, stored.tables[solver], MemoryProbe("cpu"), name=served,
                    runtime_options=options)
    load_s = time.perf_counter() - t0
    try:
        seen = round(worker.making_seen, 3)
        factor = served_factor(seen)
        # the load above asked SESSION_GROWTH x its largest session's weights (an integer
        # factor: exact); served, that session asks the factor served x them, as the runtime
        # computes it
        making = math.ceil(factor * (worker.making_bytes // SESSION_GROWTH))
        cost = LoadCost(kept_bytes=worker.kept_bytes(), load_s=round(load_s, 3),
                        weights_bytes=model.weights_bytes, held_bytes=worker.held_bytes,
                        making_bytes=making, making_factor=factor, making_seen=seen,
                        buffer_bytes=worker.buffer_bytes)
    finally:
        worker.release()
    return stored.compiled_id, cost


def _measure_torch(store: PlanStore, served: str, spec: ModelSpec, solver: str, objective: str,
                   options: RuntimeOptions, given: dict[str, Any]) -> tuple[str, LoadCost]:
    """The torch worker's load of ``served`` in this process, which has not imported torch
    (a worker without torch's, as the default worker's process is before such a model): what
    the process grew by (kept) and at its peak (what the load needs free), torch's import
    included; its sessions ask the bound (``SESSION_GROWTH``)."""
    first = status_bytes("VmRSS")  # before the planner's modules import torch
    reset_peak()
    t0 = time.perf_counter()
    from planner.pipeline import capture_served, read_prepared
    from planner.settings import Settings
    from planner.stored import compiled_key, planned_for

    settings = Settings(**given["settings"])
    # as the service's torch worker captures it: at the precision `vbs plan` recorded
    model = capture_served(spec, settings, store, served,
                           planned_for(settings, store, served, spec),
                           batch_max=given["batch_max"], grid=given["grid"],
                           weights_dir=settings.cache_dir / "weights")
    prepared = read_prepared(model, store, solver=solver, objective=objective, repair=False)
    cid = store.get_model(compiled_key(served, spec))
    if prepared is None or cid is None:
        raise TableNotFoundError(f"{served}: no tables of {model.fingerprint} or no compiled "
                                 f"model in {store.location}: run `vbs plan` for it")
    worker = Worker(model.capture, prepared.table, MemoryProbe(spec.device), name=served,
                    runtime_options=options)
    load_s = time.perf_counter() - t0
    try:
        kept = max(worker.kept_bytes(), status_bytes("VmRSS") - first)
        cost = LoadCost(kept_bytes=kept, load_s=round(load_s, 3),
                        weights_bytes=worker.model.weights_bytes, held_bytes=worker.held_bytes,
                        making_bytes=max(worker.making_bytes, status_bytes("VmHWM") - first),
                        with_torch=True, buffer_bytes=worker.buffer_bytes)
    finally:
        worker.release()
    return cid, cost


def record_load(store: PlanStore, location: str, served: str, spec: ModelSpec, solver: str,
                objective: str, options: RuntimeOptions | None = None, *,
                torch_settings: dict[str, Any] | None = None) -> LoadCost:
    """``measure_load``, stored beside the compiled model in ``store`` (opened at
    ``location``: ``PlanStore.put_load``)."""
    cid, cost = measure_load(location, served, spec, solver, objective, options,
                             torch_settings=torch_settings)
    store.put_load(cid, cost.to_bytes())
    return cost


def read_load(store: PlanStore, compiled_id: str) -> LoadCost | None:
    """The figures `vbs plan` stored for ``compiled_id``, or None where it stored none."""
    data = store.get_load(compiled_id)
    if data is None:
        return None
    return LoadCost.from_bytes(data, f"load figures of compiled model {compiled_id} in "
                                     f"{store.location}")


def _main() -> None:
    from planner.store import open_store

    job = json.loads(sys.stdin.read())
    raw = job["spec"]
    spec = ModelSpec(raw["name"], input_shape=tuple(raw["input_shape"]) if raw["input_shape"]
                     else None, dtype=raw["dtype"], device=raw["device"],
                     weights=Path(raw["weights"]) if raw["weights"] else None)
    options = replace(RuntimeOptions(), **job["options"])
    try:
        store = open_store(job["location"])
        try:
            args = (store, job["served"], spec, job["solver"], job["objective"], options)
            cid, cost = (_measure_torch(*args, job["torch"]) if job.get("torch")
                         else _measure_here(*args))
        finally:
            store.close()
        out: dict = {"compiled_id": cid, "cost": asdict(cost)}
    except VbsError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main()
