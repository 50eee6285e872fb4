"""torch in float32 and in a half precision (bfloat16, or float16 with ``--dtype``), the model's
own call against its units run one by one as the executor's torch steps run them
(``core.runner.run_node``), per sample, interleaved rounds.

    .venv/bin/python bench/torch_bf16.py --model resnet50 [--dtype float16] [--batch 1,8] [--rounds 5]

What `--precision bfloat16` serves is "bfloat16 units": where it is far slower than
"bfloat16 model(x)", the gap is what running the model unit by unit costs torch in bfloat16
(docs/benchmarks.md, section 13, "bfloat16"). A half precision runs channels_last on the CPU
(``planner.models.channels_last``); "bfloat16 NCHW" is the same model captured in the layout it
ran in before, timed in the same rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.loaded import LoadedModel  # noqa: E402
from core.runner import run_node  # noqa: E402
from core.spec import ModelSpec  # noqa: E402
from core.units import MODULE_GATE  # noqa: E402
from planner.graph.capture import capture  # noqa: E402
from planner.models import load_model  # noqa: E402
from planner.precision_half import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = ap.parse_args()
    half = args.dtype
    caps = {dtype: capture(load_model(ModelSpec(args.model, dtype=dtype)))
            for dtype in ("float32", half)}
    if caps[half].model.channels_last:
        caps[f"{half} NCHW"] = capture(_contiguous(load_model(ModelSpec(args.model, dtype=half))))
    print(f"{args.model}, {torch.get_num_threads()} threads, {half} kernels: "
          f"{native(torch.device('cpu'), half)}; ms a sample (median of {args.rounds} rounds)")
    for b in (int(v) for v in args.batch.split(",")):
        runs = {}
        for dtype, cap in caps.items():
            x = cap.model.example(b, seed=7)
            runs[f"{dtype} model(x)"] = (lambda m=cap.model.module, x=x: m(x))
            runs[f"{dtype} units"] = (lambda c=cap, x=x: run_node(c, c.tree, x))
        seen: dict[str, list[float]] = {k: [] for k in runs}
        with torch.inference_mode(), MODULE_GATE.running():
            for k in range(2 + args.rounds):
                for name, run in (runs.items() if k % 2 else reversed(runs.items())):
                    t0 = time.perf_counter()
                    run()
                    if k >= 2:
                        seen[name].append(time.perf_counter() - t0)
        print(f"  {b} samples: " + ", ".join(
            f"{name} {1e3 * statistics.median(v) / b:.2f}" for name, v in seen.items()))
    x = caps["float32"].model.example(2, seed=7)
    with torch.inference_mode(), MODULE_GATE.running():  # a half's range: under- or overflow
        print("  largest |output| of 2 samples: " + ", ".join(
            f"{dtype} {float(cap.model.module(x.to(cap.model.torch_dtype)).abs().max()):.3g}"
            for dtype, cap in caps.items()))


def _contiguous(model: LoadedModel) -> LoadedModel:
    """``model`` put back in the default layout (NCHW), as a half precision ran before."""
    model.module.to(memory_format=torch.contiguous_format)
    return replace(model, channels_last=False)


if __name__ == "__main__":
    main()
