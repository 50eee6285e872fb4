"""Issue 55's done-when, read from the GPU run's records: each criterion, its figure, met or not.

The benches counted are the float32 ones with CUDA graphs at r = 12 (`vbs bench --runtime
cudagraph`); the served figures are the serve step's. A criterion whose records are absent
(a step not run, or skipped by the deadline) is "not measured", never met.
"""

from __future__ import annotations

from typing import Any

MODELS = 5          # googlenet, resnet50, squeezenet1_0, mobilenet_v2, c3d
GAIN, MODELS_GAINING, FLOOR = 1.3, 3, 0.95
MAPE = 15.0
PEAKS = 3
SERVED_GAIN, OFFLINE_SHARE = 1.3, 0.8


def _graph_benches(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    bench = records.get("bench") or {}
    return [b for b in bench.get("items", []) if b.get("runtime") == "cudagraph"
            and b.get("dtype") == "float32" and b.get("batch") == 12]


def _gains(b: dict[str, Any]) -> list[float]:
    return [r["gain_over_fbs_best"] for r in b.get("rows", [])
            if r.get("strategy") == "vbs" and r.get("gain_over_fbs_best")]


def _bench_criteria(benches: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    done = [b for b in benches if "summary" in b]
    if not benches:
        return [(c, "no float32 bench with graphs in these records", None) for c in (
            "every run of every plan captured (r = 12, float32)",
            f"vbs vs fbs-best with graphs >= {GAIN}x for {MODELS_GAINING}+ models, never "
            f"< {FLOOR}x", f"time MAPE <= {MAPE:.0f}%",
            "claimed peak = measured in every run, 0 over budget")]
    plans = [b.get("plans") or {} for b in done]
    captured = (f"{len(done)} of {MODELS} models ran; plans ran "
                f"{sum(p.get('ran', 0) for p in plans)} of "
                f"{sum(p.get('feasible', 0) for p in plans)} feasible, "
                f"{sum(p.get('with_calls', 0) for p in plans)} with graph calls; failed: "
                + (", ".join(b["model"] for b in benches if "summary" not in b) or "none"))
    spans = {b["model"]: _gains(b) for b in done}
    gaining = [m for m, g in spans.items() if g and max(g) >= GAIN]
    lowest = min((min(g) for g in spans.values() if g), default=None)
    gain = (", ".join(f"{m} {min(g):.2f}-{max(g):.2f}x" for m, g in spans.items() if g)
            or "no vbs run measured") + f"; {len(gaining)} at >= {GAIN}x"
    mapes = {b["model"]: b["summary"].get("time_mape") for b in done}
    runs = sum(b["summary"]["runs"] for b in done)
    claimed = sum(b["summary"]["claimed_equals_measured"] for b in done)
    over = sum(b["summary"]["budget_exceeded"] for b in done)
    return [
        ("every run of every plan captured (r = 12, float32)", captured,
         len(done) == MODELS and all(p.get("ran") == p.get("feasible") for p in plans)),
        (f"vbs vs fbs-best with graphs >= {GAIN}x for {MODELS_GAINING}+ models, never "
         f"< {FLOOR}x", gain,
         len(gaining) >= MODELS_GAINING and lowest is not None and lowest >= FLOOR),
        (f"time MAPE <= {MAPE:.0f}%", ", ".join(f"{m} {v:.1f}%" for m, v in mapes.items()
                                                if v is not None) or "—",
         bool(mapes) and all(v is not None and v <= MAPE for v in mapes.values())),
        ("claimed peak = measured in every run, 0 over budget",
         f"{claimed} of {runs} runs; {over} over budget",
         runs > 0 and claimed == runs and not over),
    ]


def _serve_criteria(serve: dict[str, Any] | None, ratios: dict[str, Any]
                    ) -> list[tuple[str, str, bool | None]]:
    names = (f"served: plans at >= {PEAKS} distinct peaks as the hog moves",
             "served: 0 requests lost",
             f"served: vbs's samples/s >= {SERVED_GAIN}x fbs-best's",
             f"served: vbs >= {OFFLINE_SHARE}x the same plans offline")
    served = [one for one in (serve or {}).get("items", []) if "solver" in one]
    if not served:
        return [(n, "no served run in these records", None) for n in names]
    vbs = next((one for one in served if one["solver"] == "vbs"), {})
    moving = vbs.get("moving") or {}
    distinct = moving.get("distinct_settled")
    lost = []
    for one in served:
        m = one.get("metrics") or {}
        errors = (one.get("load") or {}).get("errors", 0) + \
            ((one.get("moving") or {}).get("load") or {}).get("errors", 0)
        lost.append(errors + m.get("rejected", 0) + m.get("requests_5xx", 0))
    over, share = ratios.get("over_fbs_best"), ratios.get("over_offline")
    cuda = (serve or {}).get("device") == "cuda"  # the CPU's hog is not the service's memory
    return [
        (names[0], (f"{distinct} (settled per step: {moving.get('settled_peaks')})"
                    if moving else "no moving window") + ("" if cuda else "; the CPU: not "
                                                          "expected to move"),
         distinct >= PEAKS if moving and cuda else None),
        (names[1], " + ".join(f"{one['solver']} {n:.0f}" for one, n in zip(served, lost)),
         all(one.get("ready") for one in served) and sum(lost) == 0),
        (names[2], f"{over:.2f}x" if over else "—", over >= SERVED_GAIN if over else None),
        (names[3], f"{share:.2f}x" if share else "—", share >= OFFLINE_SHARE if share else None),
    ]


def criteria(records: dict[str, dict[str, Any]], ratios: dict[str, Any]
             ) -> list[tuple[str, str, bool | None]]:
    """(criterion, figure, met: True, False, or None when not measured: also every one of a
    run not wholly on CUDA, whose figures are no GPU's)."""
    rows = _bench_criteria(_graph_benches(records)) + _serve_criteria(records.get("serve"),
                                                                      ratios)
    if {r.get("device") for step, r in records.items() if step != "summary"} != {"cuda"}:
        return [(name, f"{figure} (not a GPU's)", None) for name, figure, _ in rows]
    return rows


def done_when(records: dict[str, dict[str, Any]], ratios: dict[str, Any]) -> list[str]:
    rows = criteria(records, ratios)
    lines = ["## Issue 55: done when", "", "| criterion | figure | met |", "|---|---|---|"]
    word = {True: "yes", False: "**no**", None: "not measured"}
    lines += [f"| {name} | {figure} | {word[None if met is None else bool(met)]} |"
              for name, figure, met in rows]
    return lines + [""]
