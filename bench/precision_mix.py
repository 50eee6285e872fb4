"""Why the DP does not choose int8 or float32 unit by unit on ONNX Runtime: a unit's speed in
int8 alone says little of its speed among int8 neighbours.

    .venv/bin/python bench/precision_mix.py --model mobilenet_v2 --calibration DIR
                                            [--batch 8] [--rounds 20]

Each unit's graph quantized as `vbs plan --precision int8` quantizes it (``planner.precision``,
calibrated on ``--calibration``'s fit samples), then timed alone at ``--batch`` in float32 and
in int8 (the unit's own input, vbs-serve's session options, medians of interleaved calls).
Then the whole model composed three ways, as a plan of one call runs it, timed interleaved for
``--rounds`` rounds: every unit float32, every quantized unit int8, and int8 only where the unit
alone ran faster in int8. Prints how many units ran faster alone and the three medians.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.precision_context import THREADS, arguments, quantized  # noqa: E402
from core.runner import run_node, run_unit  # noqa: E402
from core.runtimes.onnx_compose import UnitGraphs  # noqa: E402
from core.runtimes.ort_sessions import session_options  # noqa: E402
from core.units import MODULE_GATE  # noqa: E402


def _median_s(call: Callable[[], object], calls: int = 15, skip: int = 3) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[skip:])


def main() -> None:
    args = arguments(__doc__, batch=8, rounds=20)
    cap, samples, graphs, units = quantized(args.model, args.calibration)
    x = np.resize(samples.fit, (args.batch, *samples.fit.shape[1:])).astype(np.float32)
    inputs: dict[str, np.ndarray] = {}

    def runner(unit, y, own):  # type: ignore[no-untyped-def]
        inputs[unit.name] = y.contiguous().numpy()
        return run_unit(cap, unit, y)

    with torch.inference_mode(), MODULE_GATE.running():
        run_node(cap, cap.tree, torch.from_numpy(x), runner=runner)
    options = session_options(THREADS)

    def session(graph) -> ort.InferenceSession:  # type: ignore[no-untyped-def]
        return ort.InferenceSession(graph.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])

    faster = []
    for name, unit in units.items():
        f32, int8 = session(graphs.units[name]), session(unit.graph)
        feed = {"x": inputs[name]}
        tf = ti = 0.0
        for _ in range(2):  # float32 then int8, twice: drift hits both
            tf += _median_s(lambda: f32.run(None, feed))
            ti += _median_s(lambda: int8.run(None, feed))
        if ti < tf:
            faster.append(name)
    print(f"{args.model}: {len(faster)} of {len(units)} quantized units ran faster in int8 "
          f"alone at {args.batch} samples")

    def whole(kept: list[str]) -> ort.InferenceSession:
        mixed = UnitGraphs(graphs.shapes, {**graphs.units, **{n: units[n].graph for n in kept}},
                           graphs.joins, graphs.failed)
        return session(mixed.compose(graphs.shapes.tree.children))

    ways = {"float32": whole([]), "int8 (every quantized unit)": whole(list(units)),
            "int8 where faster alone": whole(faster)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    feed = {"x": x}
    for k in range(args.rounds + 2):
        for way in (list(ways) if k % 2 else list(ways)[::-1]):
            t0 = time.perf_counter()
            ways[way].run(None, feed)
            if k >= 2:  # two warm-up rounds
                times[way].append(time.perf_counter() - t0)
    for way, seen in times.items():
        print(f"  {way:28s} {1e3 * statistics.median(seen):8.2f} ms  (p25 "
              f"{1e3 * float(np.percentile(seen, 25)):.2f}, p75 "
              f"{1e3 * float(np.percentile(seen, 75)):.2f})")


if __name__ == "__main__":
    main()
