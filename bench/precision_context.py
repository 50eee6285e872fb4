"""Does a unit's int8 price *inside the whole model* pick the units worth their int8?

    .venv/bin/python bench/precision_context.py --model mobilenet_v2 --calibration DIR
                                                [--passes 7] [--rounds 15]

`bench/precision_mix.py` priced each unit alone and found that says little (an int8 unit's
neighbours keep its tensors quantized). Here each unit is priced where it runs: the whole model
composed twice, every unit float32 and every quantized unit int8 (as `vbs plan --precision
int8` quantizes them, on ``--calibration``'s fit samples), each run ``--passes`` times at one
sample and at 8 with ONNX Runtime's profiler on; a unit's time is its kernels' (node names carry
the unit, ``planner.profiling.ort.kernel_times``, as the profile prices units). A unit stays
int8 where its kernels per sample, the two sizes summed, took less in int8 than in float32.
Then the whole model four ways, timed interleaved for ``--rounds`` rounds at both sizes:
float32, every quantized unit int8, int8 where the unit's price in context was lower, and the
whole float32 graph quantized at once (as a user quantizes a model for Triton; same samples,
same quantizer). Prints the units chosen and the medians (ms per call) with their quartiles,
then where the two int8 graphs spend their kernels' time at 8 samples, by ONNX Runtime op.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.runtimes.onnx_compose import UnitGraphs  # noqa: E402
from core.runtimes.onnx_graphs import export_units  # noqa: E402
from core.runtimes.ort_sessions import session_options  # noqa: E402
from core.spec import ModelSpec  # noqa: E402
from core.tree import Layer, Parallel, iter_nodes  # noqa: E402
from core.units import Capture  # noqa: E402
from planner.calibration import Calibration, read_calibration  # noqa: E402
from planner.graph.capture import capture  # noqa: E402
from planner.models import load_model  # noqa: E402
from planner.precision import _quantize, _quantize_units  # noqa: E402
from planner.profiling.ort import _Profiled, kernel_times  # noqa: E402

THREADS = 2
BATCHES = (1, 8)


def _session(graph, profiled: bool = False) -> tuple[ort.InferenceSession, str]:  # type: ignore[no-untyped-def]
    options = session_options(THREADS)
    directory = ""
    if profiled:
        directory = tempfile.mkdtemp(prefix="vbs-ctx-")
        options.enable_profiling = True
        options.profile_file_prefix = f"{directory}/run"
    return ort.InferenceSession(graph.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]), directory


def _priced(graph, tree, feeds: dict[int, np.ndarray], passes: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Each unit's (and block's) kernel seconds per sample, the sizes' medians summed."""
    session, directory = _session(graph, profiled=True)
    owner = {n.name: n.name for n in iter_nodes(tree) if isinstance(n, (Layer, Parallel))}
    p = _Profiled(session, owner, directory)
    for b, x in feeds.items():
        for k in range(passes + 1):
            p.calls.append((b, k > 0))  # the first call of each size warms up
            session.run(None, {"x": x})
    times = kernel_times([p])
    return {name: sum(statistics.median(per[b]) / b for b in per) for name, per in times.items()}


def _by_op(graph, x: np.ndarray, calls: int = 6) -> collections.Counter:  # type: ignore[no-untyped-def]
    """Milliseconds per call of each ONNX Runtime op's kernels (its profiler's events)."""
    session, directory = _session(graph, profiled=True)
    try:
        for _ in range(calls + 1):
            session.run(None, {"x": x})
        with open(session.end_profiling()) as f:
            events = json.load(f)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    ms: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
            ms[event.get("args", {}).get("op_name", "?")] += float(event["dur"]) / 1e3 / (calls + 1)
    return ms


def quantized(model: str, calibration: Path) -> tuple[Capture, Calibration, UnitGraphs, dict]:
    """``model`` captured, its samples in ``calibration``, its units' graphs, and its units
    quantized as `vbs plan --precision int8` quantizes them (``planner.precision``)."""
    torch.set_num_threads(THREADS)
    cap = capture(load_model(ModelSpec(model)))
    samples = read_calibration(calibration, model, cap.input_shape)
    graphs = export_units(cap)
    return cap, samples, graphs, _quantize_units(cap, graphs, samples)


def arguments(doc: str, **counts: int) -> argparse.Namespace:
    """``--model`` and ``--calibration``, and an integer option for each of ``counts`` (its
    default)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--calibration", required=True, type=Path)
    for name, default in counts.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    return ap.parse_args()


def main() -> None:
    args = arguments(__doc__, passes=7, rounds=15)
    _, samples, graphs, units = quantized(args.model, args.calibration)
    feeds = {b: np.ascontiguousarray(np.resize(samples.fit, (b, *samples.fit.shape[1:])),
                                     dtype=np.float32) for b in BATCHES}
    nodes = graphs.shapes.tree.children

    def mixed(kept: list[str]) -> UnitGraphs:
        return UnitGraphs(graphs.shapes, {**graphs.units, **{n: units[n].graph for n in kept}},
                          graphs.joins, graphs.failed)

    f32 = _priced(mixed([]).compose(nodes), graphs.shapes.tree, feeds, args.passes)
    i8 = _priced(mixed(list(units)).compose(nodes), graphs.shapes.tree, feeds, args.passes)
    chosen = [n for n in units if i8.get(n, 0.0) < f32.get(n, 0.0)]
    print(f"{args.model}: {len(chosen)} of {len(units)} quantized units priced lower in int8 in "
          f"context; kernels per sample (1 + 8 summed): float32 {1e3 * sum(f32.values()):.2f} "
          f"ms, int8 {1e3 * sum(i8.values()):.2f}, the chosen mix "
          f"{1e3 * sum(i8[n] if n in chosen else f32.get(n, 0.0) for n in f32):.2f}")
    ways = {"float32": [], "int8 (every quantized unit)": list(units),
            "int8 where lower in context": chosen}
    graphs_of = {w: mixed(kept).compose(nodes) for w, kept in ways.items()}
    with tempfile.TemporaryDirectory(prefix="vbs-whole-") as work:
        whole = _quantize(graphs_of["float32"], samples.fit, Path(work))
    if whole is not None:  # the whole float32 graph quantized at once, as a user would
        graphs_of["int8 (the whole graph at once)"] = whole
    sessions = {w: _session(g)[0] for w, g in graphs_of.items()}
    seen: dict[tuple[str, int], list[float]] = {(w, b): [] for w in sessions for b in BATCHES}
    order = list(seen)
    for k in range(args.rounds + 2):
        for way, b in (order if k % 2 else order[::-1]):
            t0 = time.perf_counter()
            sessions[way].run(None, {"x": feeds[b]})
            if k >= 2:
                seen[way, b].append(time.perf_counter() - t0)
    for b in BATCHES:
        base = statistics.median(seen["float32", b])
        for way in sessions:
            s = seen[way, b]
            print(f"  {b} sample(s) {way:28s} {1e3 * statistics.median(s):8.2f} ms (p25 "
                  f"{1e3 * float(np.percentile(s, 25)):.2f}, p75 "
                  f"{1e3 * float(np.percentile(s, 75)):.2f})  float32's speed x"
                  f"{base / statistics.median(s):.2f}")
    for way in ("int8 (every quantized unit)", "int8 (the whole graph at once)"):
        if way in graphs_of:
            ms = _by_op(graphs_of[way], feeds[BATCHES[-1]])
            print(f"  {way}, kernels at {BATCHES[-1]} samples: {sum(ms.values()):.1f} ms; "
                  + ", ".join(f"{op} {t:.1f}" for op, t in ms.most_common(7)))


if __name__ == "__main__":
    main()
