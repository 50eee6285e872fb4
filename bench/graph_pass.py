"""One pass of a whole model as one CUDA graph against eager torch, at a request size.

    python -m bench.graph_pass --model resnet50 [--input-shape 3,224,224] --device cuda
                               [--dtype float32] [--samples 1] [--repeat 50] [--json]

Eager: ``model(x)``, the launches paced by the host. Graph: the model's units captured as one
run (``core.runtimes.cudagraph``) and called as a plan of one call runs it: the request
copied into the graph's static input, one replay, the output copied into a buffer of its own.
Both timed interleaved, each call synchronised (the request's latency), ``--repeat`` rounds;
the median and the spread ((max - min) / median) of each, the speed-up, the largest absolute
difference of the graph's output from ``model(x)`` (and whether it is within the dtype's
tolerance), and what the graph keeps (its pool and static buffers). Where CUDA graphs cannot
run (the CPU) it says why and times eager alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _stats(times: list[float]) -> dict[str, float]:
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "spread": (max(times) - min(times)) / median}


def measure(model: str, shape: tuple[int, ...] | None, device: str, dtype: str, samples: int,
            repeat: int) -> dict[str, Any]:
    from core.loaded import ModelSpec
    from core.runtimes.cudagraph import GraphUnits, unavailable
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.profiling.measure import differs

    loaded = load_model(ModelSpec(model, input_shape=shape, dtype=dtype, device=device))
    cap = capture(loaded)
    x = loaded.example(samples, seed=3)
    out: dict[str, Any] = {"model": model, "input_shape": list(cap.input_shape), "dtype": dtype,
                           "device": device, "samples": samples, "repeat": repeat,
                           "device_name": torch.cuda.get_device_name(loaded.device)
                           if loaded.device.type == "cuda" else "cpu"}
    why = unavailable(cap)
    runs: dict[str, Callable[[], Any]] = {"eager": lambda: loaded.module(x)}
    graphs = None
    nodes = tuple(cap.tree.children)
    if why:
        out["graph_unavailable"] = why
    else:
        graphs = GraphUnits(cap)
        runs["graph"] = lambda: graphs.call(nodes, x, samples)  # type: ignore[union-attr]
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        want = loaded.module(x)
        for fn in runs.values():  # warm-up (and the graph's capture)
            fn()
        for _ in range(repeat):
            for name, fn in runs.items():
                times[name].append(_timed(fn, loaded.device))
        if graphs is not None:
            got = graphs.call(nodes, x, samples)
            out["max_abs_error"] = float((got.float() - want.float()).abs().max())
            out["within_tolerance"] = not differs(got, want)
            out["graph_held_bytes"] = graphs.held_bytes
            out["graph_pool_bytes"] = graphs.cached_bytes
    for name, ts in times.items():
        out[name] = _stats(ts)
    if "graph" in out:
        out["speedup"] = out["eager"]["median_ms"] / out["graph"]["median_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--input-shape", help="per sample, C,H,W (default: the model's)")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.input_shape.split(",")) if args.input_shape else None
    result = measure(args.model, shape, args.device, args.dtype, args.samples, args.repeat)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model} {result['input_shape']} {args.dtype} on {result['device_name']}, "
          f"{args.samples} sample(s), {args.repeat} interleaved rounds")
    for name in ("eager", "graph"):
        if name in result:
            print(f"  {name:6} {result[name]['median_ms']:8.3f} ms  (spread "
                  f"{100 * result[name]['spread']:.0f}%)")
    if "speedup" in result:
        print(f"  graph {result['speedup']:.2f}x eager; max |error| {result['max_abs_error']:.3g} "
              f"({'within' if result['within_tolerance'] else 'OUTSIDE'} the dtype's tolerance); "
              f"keeps {result['graph_held_bytes'] / 2**20:.1f} MiB")
    else:
        print(f"  graph: {result['graph_unavailable']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
