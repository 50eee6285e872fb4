"""The int8 model `vbs plan --precision` compiled, as one ONNX file: what a user who quantized
the model alone would serve on Triton (``bench/peers.py --int8 FILE``).

    python bench/int8_export.py --store DIR --served resnet50-int8 --model resnet50 --out F.onnx

Every unit's graph as the store holds it (int8 where the guard kept it, float32 elsewhere),
composed into one graph over the whole tree (``core.runtimes.onnx_compose``): the same
kernels and weights the worker runs, in one call. Prints its units' precision and its
weights' bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.precision import Precision  # noqa: E402
from core.shapes import parse_shape  # noqa: E402
from core.spec import ModelSpec  # noqa: E402
from planner.store import open_store  # noqa: E402
from planner.stored import read_compiled  # noqa: E402


def served_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments that name a served model in a store (``read_served`` reads it)."""
    ap.add_argument("--store", required=True)
    ap.add_argument("--served", required=True, help="the alias it was planned under")
    ap.add_argument("--model", required=True)
    ap.add_argument("--input-shape", help="as it was planned with (MODEL@C,H,W), if it was")


def read_served(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The compiled model and tables ``served_arguments`` named (``read_compiled``'s)."""
    shape = parse_shape(args.input_shape) if args.input_shape else None
    with open_store(args.store) as store:
        return read_compiled(store, args.served, ModelSpec(args.model, input_shape=shape),
                             "vbs", "time", **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    served_arguments(ap)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    stored = read_served(args)
    graphs = stored.compiled.graphs
    whole = graphs.compose(graphs.shapes.tree.children)
    onnx.checker.check_model(whole)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(whole, str(args.out))
    precision = Precision.from_json(stored.compiled.meta.get("precision"))
    weights = sum(len(t.raw_data) for t in whole.graph.initializer)
    print(f"{args.out}: {len(precision.int8)} of {len(graphs.units)} units int8 "
          f"(top-1 agreement {100 * precision.agreement:.1f}% on {precision.held_out} held-out "
          f"samples), weights {weights / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
