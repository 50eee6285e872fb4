"""What bench/many_models.py prints: the footprints alone against each limit, a row for every
server in every limit, and one for every model in it."""

from __future__ import annotations

import argparse
import collections
import math
from typing import Any

from many_models_servers import MiB
from many_models_traffic import zipf


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] if xs else None


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def per_model(row: dict[str, Any], models: list[str]) -> list[str]:
    out = []
    recs = row.get("records", [])
    total = len(recs) or 1
    metrics = row.get("metrics") or {}
    before = row.get("metrics_before") or {}
    for model in models:
        mine = [r for r in recs if r[0] == model]
        ok = [r for r in mine if r[1] == "200"]
        errors = collections.Counter(r[1] for r in mine if r[1] != "200")
        err = ", ".join(f"{n} x {s}" for s, n in sorted(errors.items())) or "0"
        waited = [max(r[3], r[4]) for r in ok if r[3] > 0 or r[4] > 0]
        if row["server"] == "vbs" and metrics:
            loads = metrics["loads"].get(model, 0) - before.get("loads", {}).get(model, 0)
            unloads = metrics["unloads"].get(model, 0) - before.get("unloads", {}).get(model, 0)
            lc = f"{loads:.0f} / {unloads:.0f}"
        elif row.get("client"):
            lc = "{} / {} (client)".format(*row["client"]["by_model"].get(model, [0, 0]))
        else:
            lc = ""
        out.append(f"| {row['server']} | {row['limit'] / MiB:.0f} | {model} | "
                   f"{100 * len(mine) / total:.1f}% | {len(mine)} | "
                   f"{len(ok)} | {err} | {ms(pct([r[2] for r in ok], 0.5))} | "
                   f"{ms(pct([r[2] for r in ok], 0.99))} | "
                   f"{len(waited)} ({ms(pct(waited, 0.5))}) | {lc} |")
    return out


def summary(row: dict[str, Any]) -> str:
    limit = row["limit"] / MiB
    peak = f"{(row.get('peak') or 0) / MiB:.0f}"
    if not row.get("started"):
        return (f"| {row['server']} | {limit:.0f} | did not start ({row['error']}, after "
                f"{row['start_s']:.0f} s) | - | - | - | - | - | - | - | {peak} | "
                f"{row['oom_kills']} | - |")
    recs = row["records"]
    ok = [r for r in recs if r[1] == "200"]
    lat = [r[2] for r in ok]
    if row["server"] == "vbs" and row.get("metrics"):
        m, b = row["metrics"], row.get("metrics_before") or {}
        loads = sum(m["loads"].values()) - sum(b.get("loads", {}).values())
        unloads = sum(m["unloads"].values()) - sum(b.get("unloads", {}).values())
        load_s = sum(m["load_sum"].values()) - sum(b.get("load_sum", {}).values())
        changes = (f"{loads:.0f} / {unloads:.0f} | {load_s / loads:.2f} s mean"
                   if loads else f"0 / {unloads:.0f} | -")
        changes += " (server)"
    elif row.get("client"):
        c = row["client"]
        t = c["load_times"]
        mean = f"{c['load_s'] / c['loads']:.2f} s mean" if c["loads"] else "-"
        changes = (f"{c['loads']} / {c['unloads']} | {mean} (client: {c['load_s']:.1f} s "
                   f"loading, {c['unload_s']:.1f} s unloading; {c['failed_loads']} failed "
                   f"loads; p50 {ms(pct(t, 0.5))} ms)")
    else:
        changes = "- | -"
    alive = "yes" if row["alive"] else f"no (exit {row['exit']})"
    return (f"| {row['server']} | {limit:.0f} | {len(recs)} | {len(ok)} | {len(recs) - len(ok)} | "
            f"{len(ok) / row['duration']:.1f} | {ms(pct(lat, 0.5))} | {ms(pct(lat, 0.99))} | "
            f"{changes} | {peak} | {row['oom_kills']} | {alive} |")


def print_footprints(args: argparse.Namespace, fp_vbs: dict[str, dict[str, Any]],
                     fp_triton: dict[str, dict[str, Any]], triton_base: int,
                     limits: list[tuple[str, int]]) -> None:
    from core.spec import ModelSpec
    from planner.models import sketch_model

    print("| model | weights (MiB) | vbs-serve alone: group peak (MiB) | vbs-serve: the "
          "model keeps (MiB) | vbs-serve load (s) | Triton alone: group peak (MiB) | Triton: "
          "growth over the idle server (MiB) | Triton load (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        w = sketch_model(ModelSpec(model, input_shape=tuple(args.shape))).weights_bytes
        v, t = fp_vbs[model], fp_triton.get(model, {})
        load = f"{v['load_s']:.1f}" if v.get("load_s") is not None else "-"
        print(f"| {model} | {w / MiB:.0f} | {(v['peak'] or 0) / MiB:.0f} | "
              f"{(v['kept'] or 0) / MiB:.0f} | {load} | {(t.get('peak') or 0) / MiB:.0f} | "
              f"{t.get('growth', 0) / MiB:.0f} | {t.get('load_s', 0):.1f} |")
    sum_vbs = sum(f["peak"] or 0 for f in fp_vbs.values())
    sum_triton = sum(f["peak"] or 0 for f in fp_triton.values())
    kept = sum(f["kept"] or 0 for f in fp_vbs.values())
    growth = sum(f["growth"] for f in fp_triton.values())
    print(f"\nfootprints alone together: vbs-serve {sum_vbs / MiB:.0f} MiB, Triton "
          f"{sum_triton / MiB:.0f} MiB; what the models themselves keep together: vbs-serve "
          f"{kept / MiB:.0f} MiB, Triton's stubs {growth / MiB:.0f} MiB over its idle server "
          f"({triton_base / MiB:.0f} MiB)")
    for name, limit in limits:
        print(f"limit {name}: {limit / MiB:.0f} MiB; the footprints alone together are "
              f"{sum_vbs / limit:.1f}x it (vbs-serve's), {sum_triton / limit:.1f}x "
              f"(Triton's)")
    print(f"traffic: Zipf s = {args.zipf}: " + ", ".join(
        f"{m} {100 * p:.1f}%" for m, p in zip(args.models, zipf(len(args.models), args.zipf)))
        + "\n", flush=True)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("| server | limit (MiB) | requests | answered | errors | answered/s | p50 (ms) | "
          "p99 (ms) | loads / unloads | load time | group peak (MiB) | OOM kills | alive at "
          "the end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(summary(row))
    print("\n| server | limit (MiB) | model | share | requests | answered | errors | p50 (ms) "
          "| p99 (ms) | answered after a load wait (its p50 ms) | loads / unloads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row.get("started"):
            print("\n".join(per_model(row, args.models)))
    for row in rows:
        where = f"{row['server']} in {row['limit'] / MiB:.0f} MiB"
        if row.get("at_start") is not None:
            print(f"\n{where}: loaded at start: {', '.join(row['at_start']) or 'none'}")
        if row.get("log"):
            print(f"\n{where}, the log's last lines:\n" + row["log"])
