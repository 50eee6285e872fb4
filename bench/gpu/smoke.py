"""CUDA graphs captured in the orders the GPU run uses them, on a small model, in a minute:
the run's first step (bench/gpu/step_smoke.py), so that a capture the allocator refuses stops
the call before its benches spend it (on an H200 every bench with graphs failed so).

    python -m bench.gpu.smoke --device cuda [--model resnet18] [--shape 3,64,64]

The orders, as `vbs bench --runtime cudagraph` meets them in one process: the profiler's
(``planner.profiling.cudagraph.measure``: per batch size a ``GraphUnits`` of its own, every
unit captured alone, then the longest runs, each given back), then the bench's (one
``GraphUnits``: a small run, a larger one that grows the static buffers and so gives every
graph back, the small one again, the whole model, a larger one again), then a capture after
``release``. Every replay is checked against eager torch. Prints one JSON line (``ok``,
``stages``, ``skipped``); on the CPU it imports what the stages use and stops before the model
(capturing it takes longer there than the whole smoke on a GPU machine) with a ``CUDA only:``
reason, as the tests marked gpu do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

CUDA_ONLY = "CUDA only:"


def _stage(stages: list[dict[str, Any]], name: str, fn: Callable[[], str]) -> bool:
    """Run one stage: ``fn`` returns '' or what went wrong; an exception is a failure too."""
    t0 = time.perf_counter()
    try:
        error = fn()
    except Exception as exc:  # noqa: BLE001 - the record says what failed, the next call decides
        error = f"{type(exc).__name__}: {exc}"
    stages.append({"name": name, "ok": not error, "error": error[:1500],
                   "seconds": round(time.perf_counter() - t0, 2)})
    return not error


def _bench_order(cap: Any, units: Any) -> str:
    """One GraphUnits through runs that grow its buffers and shrink again; '' when every
    replay equals eager torch."""
    import torch

    from core.runner import run_nodes
    from planner.profiling.measure import differs

    children = tuple(cap.tree.children)
    small, half = children[:2], children[:max(3, len(children) // 2)]
    for nodes, b in ((small, 2), (half, 8), (small, 2), (children, 4), (half, 12), (small, 1)):
        x = cap.model.example(b, seed=b)
        with torch.inference_mode():
            got = units.call(nodes, x, b)
            want = run_nodes(cap, nodes, x)
        why = differs(got, want)
        if why:
            return f"{nodes[0].name}..{nodes[-1].name} on {b}: {why}"
    return ""


def _profiler_order(cap: Any) -> str:
    from planner.profiling.cudagraph import measure

    grid = [1, 2, 4]
    inputs = {b: cap.model.example(b, seed=10 + b) for b in grid}
    figures = measure(cap, grid, inputs, repeats=1)
    return "" if figures.device else "no unit's graph was measured"


def smoke(model: str, shape: tuple[int, ...], device: str) -> dict[str, Any]:
    import torch

    from core import runtimes as rt
    from core.loaded import ModelSpec
    from core.runtimes.base import RuntimeOptions
    from planner.graph.capture import capture
    from planner.models import load_model

    import planner.profiling.cudagraph  # noqa: F401 - what the stages import, imported here

    if device != "cuda" or not torch.cuda.is_available():  # before the model: a minute on 2 CPUs
        why = f"--device {device}" if device != "cuda" else "torch sees no CUDA device"
        return {"ok": True, "stages": [], "skipped": f"{CUDA_ONLY} capturing CUDA graphs ({why})"}
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec(model, input_shape=shape, device=device)))
    stages: list[dict[str, Any]] = []
    units = rt.load(rt.CUDAGRAPH, cap, RuntimeOptions())
    ok = _stage(stages, "the profiler's order: a pool per batch size, released",
                lambda: _profiler_order(cap))
    ok = ok and _stage(stages, "the bench's order: small, larger (buffers grow), small again, "
                       "whole, larger", lambda: _bench_order(cap, units))

    def again() -> str:
        units.release()
        return _bench_order(cap, units)

    ok = ok and _stage(stages, "released, then captured again", again)
    units.release()
    return {"ok": ok, "stages": stages, "skipped": ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.smoke",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--shape", default="3,64,64")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    shape = tuple(int(d) for d in args.shape.split(","))
    result = smoke(args.model, shape, args.device)
    result.update(model=args.model, shape=list(shape), seconds=round(time.perf_counter() - t0, 2))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
