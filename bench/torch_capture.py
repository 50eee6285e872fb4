"""How long a torch worker takes to capture a served name before it looks its tables up, as it
does now (``planner.pipeline.capture_served``: at the precision `vbs plan` recorded, the int8
graphs it stored) and as it did before (``capture_model`` at the server's ``VBS_PRECISION``,
quantized and guarded again from ``VBS_CALIBRATION``), each in a fresh process, and whether the
two find the same tables (fingerprints). docs/benchmarks.md, section 13.

    .venv/bin/python bench/torch_capture.py --store STORE --served mobilenet_v2-int8 \\
        --model mobilenet_v2 --precision int8 --calibration DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _once(how: str, args: argparse.Namespace) -> dict[str, object]:
    """One capture in this process (``how``: now or before), timed."""
    from core.spec import ModelSpec
    from planner.pipeline import capture_model, capture_served
    from planner.settings import Settings
    from planner.store.factory import open_store

    spec = ModelSpec(args.model)
    t0 = time.perf_counter()
    if how == "now":
        store = open_store(args.store)
        try:
            got = capture_served(spec, Settings(), store, args.served)
        finally:
            store.close()
    else:
        got = capture_model(spec, Settings(precision=args.precision,
                                           calibration=args.calibration))
    return {"how": how, "s": round(time.perf_counter() - t0, 2), "fingerprint": got.fingerprint,
            "precision": got.capture.precision.name, "int8": len(got.capture.precision.int8)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--served", required=True, help="the name it was planned under")
    p.add_argument("--model", required=True)
    p.add_argument("--precision", default="int8", help="what VBS_PRECISION said before")
    p.add_argument("--calibration", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--once", choices=["now", "before"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.once:
        print(json.dumps(_once(args.once, args)))
        return
    argv = [sys.executable, __file__, *sys.argv[1:]]
    for r in range(args.rounds):
        for how in ("now", "before"):
            done = subprocess.run([*argv, "--once", how], capture_output=True, text=True,
                                  cwd=ROOT, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {how:>6}: {got['s']:7.2f} s, {got['precision']} "
                  f"({got['int8']} units int8), fingerprint {got['fingerprint']}")


if __name__ == "__main__":
    main()
