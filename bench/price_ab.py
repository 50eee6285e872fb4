"""The served-time errors of saved `vbs bench --out` runs, one line each (bench/price_ab.sh):
the MAPE of the predictions of the plans a worker runs (vbs, fbs-best), the median of measured
over predicted (the machine's speed then against the profile's), the MAPE once every
prediction is scaled by that (what the prices get wrong between plans), and the MAPE of the
table's measured time. Runs saved before these figures were kept are summarised again here.

    .venv/bin/python bench/price_ab.py OUT/old/*.json OUT/new/*.json
"""

from __future__ import annotations

import dataclasses
import json
import sys

from workers.plans_measured import Row, time_errors


def main(paths: list[str]) -> None:
    fields = {f.name for f in dataclasses.fields(Row)}
    print(f"{'run':<40} {'MAPE':>6} {'scale':>6} {'scaled':>7} {'table':>6}")
    for path in paths:
        saved = json.load(open(path))
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in saved["rows"]]
        s = time_errors([r for r in rows if r.feasible])
        table = s["table_time_mape"]
        print(f"{path:<40} {s['served_time_mape']:>5.1f}% {s['served_time_scale']:>5.2f}x "
              f"{s['served_time_scaled_mape']:>6.1f}% "
              f"{'-' if table is None else f'{table:.1f}%':>6}")


if __name__ == "__main__":
    main(sys.argv[1:])
