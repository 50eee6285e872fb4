"""What the int8 guard keeps of a model, without profiling or planning it: the units it leaves
int8 and its top-1 agreement with float32 on the held-out samples (``planner.precision``), the
step `vbs plan --precision int8` takes before its profile, in minutes instead of tens.

    .venv/bin/python bench/int8_guard.py --model densenet161 --calibration DIR [--max-error 0.01]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.spec import ModelSpec  # noqa: E402
from planner.graph.capture import capture  # noqa: E402
from planner.models import load_model  # noqa: E402
from planner.precision import with_precision  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calibration", type=Path, required=True)
    p.add_argument("--max-error", type=float, default=0.01)
    args = p.parse_args()
    t0 = time.perf_counter()
    got = with_precision(capture(load_model(ModelSpec(args.model))), "int8", args.calibration,
                         args.max_error)
    p8 = got.precision
    print(f"{args.model}: {len(p8.int8)} units int8, top-1 agreement {100 * p8.agreement:.1f}% "
          f"on {p8.held_out} held-out samples; {p8.why} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
