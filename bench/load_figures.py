"""What each model of a store costs loaded by the worker without torch, measured now in a fresh
process as `vbs plan`'s last step does (``workers.load_cost.measure_load``), printed, not stored.
Run it at two commits to compare what a change did to a model's load (docs/benchmarks.md,
section 8).

    .venv/bin/python bench/load_figures.py --store ~/.cache/vbs-serve/many-store \\
        --shape 3,224,224 resnet50 alexnet resnet34
    .venv/bin/python bench/load_figures.py --store ~/.cache/vbs-serve/peers-store \\
        --shape default resnet50 resnet50-int8=resnet50    # section 13
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.spec import ModelSpec  # noqa: E402
from workers.load_cost import measure_load  # noqa: E402

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="served names, planned with --model "
                                               "[ALIAS=]NAME@SHAPE (give ALIAS=NAME)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--shape", default="3,224,224", help="C,H,W, or default (planned without)")
    ap.add_argument("--solver", default="vbs")
    ap.add_argument("--objective", default="time")
    args = ap.parse_args()
    shape = None if args.shape == "default" else tuple(int(d) for d in args.shape.split(","))
    for entry in args.models:
        name, _, model = entry.partition("=")
        _, c = measure_load(args.store, name, ModelSpec(name=model or name, input_shape=shape),
                            args.solver, args.objective)
        print(f"{entry}: weights {c.weights_bytes / MiB:.0f} MiB, keeps {c.kept_bytes / MiB:.0f} "
              f"(sessions {c.held_bytes / MiB:.0f}, batch buffer {c.buffer_bytes / MiB:.1f}), "
              f"making_seen {c.making_seen:.2f} per weight "
              f"byte, a session asks {c.making_factor:.2f}x ({c.making_bytes / MiB:.0f} MiB), "
              f"load {c.load_s:.2f} s")


if __name__ == "__main__":
    main()
