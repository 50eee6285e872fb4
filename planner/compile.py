"""The planner compiles: every unit of a captured model exported to ONNX once, stored beside
its tables so that a CPU worker serves it without torch (``core.compiled``).

Run by `vbs plan` after the tables are in the store (and by ``planner.pipeline.prepare`` with
``compile=True``). What is stored is the units' graphs, not one graph per run: a worker
composes each run it needs in milliseconds (``core.runtimes.onnx_compose``), and the store
holds each weight once.
"""

from __future__ import annotations

import hashlib
import logging
import time

from core.compiled import CompiledModel
from core.runtimes import ONNXRUNTIME
from core.runtimes.onnx_graphs import export_units
from core.units import Capture
from planner.families import build_preprocess, labels_for
from planner.store import PlanStore
from planner.stored import compiled_key

log = logging.getLogger("vbs.plan")


def compilable(capture: Capture) -> str:
    """Why this model gets no compiled form ('' when it does): ONNX Runtime runs float32 units
    on the CPU here."""
    from core.runtimes.onnxrt import unavailable

    return unavailable(capture)


def compile_capture(capture: Capture, fingerprint: str) -> CompiledModel:
    """Every unit and op-join of ``capture`` exported (what fails is recorded with why)."""
    import onnxruntime

    graphs = capture.graphs if capture.graphs is not None else export_units(capture)
    spec = capture.model.spec
    meta: dict[str, object] = {"fingerprint": fingerprint, "model": spec.name,
                               "input_shape": list(capture.input_shape), "dtype": spec.dtype,
                               "runtime": ONNXRUNTIME, "onnxruntime": onnxruntime.__version__,
                               "precision": capture.precision.to_json()}
    # what the service reads of the model's family (torchvision's weights' metadata), as data
    pre = build_preprocess(spec.name, tuple(capture.input_shape))
    if pre is not None and getattr(pre[0], "spec", None) is not None:
        meta["images"] = {"mode": pre[1], **pre[0].spec.to_json()}
    out = tuple(capture.output_shape)
    labels = labels_for(spec.name, out[0]) if len(out) == 1 else None
    if labels:
        meta["labels"] = labels
    return CompiledModel(graphs, meta)


def ensure_compiled(store: PlanStore, capture: Capture, fingerprint: str,
                    served: str | None = None) -> str | None:
    """Export ``capture``'s units and store them under an id of the profile's fingerprint and
    the blob's own digest (its weights differ where the fingerprint does not), pointing the
    served model's alias (``compiled_key``) at it; returns the id, or None when the model has
    no compiled form (``compilable``)."""
    why = compilable(capture)
    if why:
        log.info("%s: not compiled for workers without torch: %s", capture.model.spec.name, why)
        return None
    t0 = time.perf_counter()
    compiled = compile_capture(capture, fingerprint)
    blob = compiled.to_bytes()
    cid = f"{fingerprint}.{hashlib.sha256(blob).hexdigest()[:16]}"
    if store.get_compiled(cid) is None:
        store.put_compiled(cid, blob)
    alias = compiled_key(served or capture.model.spec.name, capture.model.spec)
    store.set_model(alias, cid)
    log.info("%s: compiled (%d units, %d bytes) in %.1f s as %s in %s", alias,
             len(compiled.graphs.units), len(blob), time.perf_counter() - t0, cid, store.location)
    return cid
