"""Calibration samples for a torchvision model with random weights: its own example inputs
(standard normal, seeded), one .npy per sample, for `vbs plan --precision --calibration DIR`.

    python bench/calibration_samples.py --model resnet50 --count 64 --out DIR

No real images ship here and the models' weights are random, so the guard's top-1 agreement
on these says only that int8 keeps what float32 answers on such inputs, not accuracy: the
trained-digits test (tests/workers/test_precision.py) is where accuracy is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.spec import ModelSpec  # noqa: E402
from planner.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    model = load_model(ModelSpec(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
        np.save(args.out / f"{i:04d}.npy", model.example(1, seed=1000 + i)[0].numpy())
    print(f"{args.count} samples of {tuple(model.input_shape)} in {args.out}")


if __name__ == "__main__":
    main()
