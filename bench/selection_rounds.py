"""The measured selection's rounds for one request size, every plan it measures, each round's
time over fbs-best's top plan's in the same round (docs/benchmarks.md section 2).

    .venv/bin/python bench/selection_rounds.py --model mobilenet_v2 --batch 4 [--rounds 7]
        [--batch-max 8] [--precision auto --calibration DIR]

The tables `vbs bench` builds (the cached profile, every strategy), then
``workers.plan_selection.measure`` as `vbs plan` runs it (vbs's row, fbs-best's, and fbs's
uniform batches above fbs-best's top), ``--rounds`` rounds. Printed per plan, fastest first:
where it comes from (strategy, peak, prediction), its median, its time in each round and that
time over fbs-best's top plan's in the same round, which is what ``selection.wins`` judges.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planner.cli import (add_model_args, add_precision_args, add_runtime_arg,  # noqa: E402
                         load_capture, settings_from)
from planner.pipeline import options_from  # noqa: E402
from planner.profiling.profiler import cached_profile  # noqa: E402
from planner.solver.compare import BASELINE, STRATEGIES  # noqa: E402
from planner.solver.selection import LARGER  # noqa: E402
from planner.solver.tables import build_tables  # noqa: E402
from workers.plan_selection import measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    add_runtime_arg(ap)
    add_precision_args(ap)
    ap.add_argument("--batch", type=int, required=True, help="the request size")
    ap.add_argument("--batch-max", type=int, help="the tables' largest request size")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    settings = settings_from(args)
    cap = load_capture(args, settings)
    options = options_from(settings, batch_max=max(args.batch, args.batch_max or args.batch))
    profile, _ = cached_profile(cap, options, settings.profile_cache, progress=False)
    tables = build_tables(profile, STRATEGIES, slot_bytes=settings.slot_bytes or None,
                          slot_count=settings.slot_count)
    r = args.batch
    seconds = measure(cap, tables["vbs"], tables[BASELINE], args.rounds, sizes=(r,),
                      bigger=tables[LARGER])
    top = tables[BASELINE].lookup(r, tables[BASELINE].top_bytes).plan_id
    origin: dict[str, str] = {}
    for solver in (BASELINE, LARGER, "vbs"):
        table = tables[solver]
        for peak, p in zip(table.row(r).peaks.tolist(), table.row(r).plans.tolist()):
            tp = table.plans[p]
            origin.setdefault(tp.plan_id, f"{solver} from {peak / 2**20:.2f} MiB, "
                                          f"predicted {1e3 * tp.time_total:.2f} ms")
    print(f"{cap.model.spec.name} r={r}: {len(seconds)} plans, {args.rounds} rounds; "
          f"fbs-best's top plan {top}")
    for plan_id, times in sorted(seconds.items(), key=lambda kv: statistics.median(kv[1])):
        ratios = [t / u for t, u in zip(times, seconds[top])]
        print(f"{plan_id} {origin.get(plan_id, ''):44s} median {1e3 * statistics.median(times):7.2f}"
              f" ms | rounds " + " ".join(f"{1e3 * t:.1f}" for t in times)
              + " | over fbs-best's top " + " ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
