"""Step ``summary``: out/gpu/*.json as summary.md, the tables docs/benchmarks.md takes.

It reads whatever steps have records (one device call brings back some; the session copies
every call's files into out/gpu/ and runs ``make gpu STEP=summary`` here), names every step
and whether it ran, and puts the paper's Table II beside our gains, cited, in columns of its
own. Its first line says on what device the figures were measured: a CPU rehearsal's are not
GPU results, and the line says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.gpu import done
from bench.gpu.paper import CITATION, TABLE_II

STEPS = ("install", "smoke", "tests", "profile", "graphs", "bench", "serve", "energy", "summary")
MiB = 2**20


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's records of several calls (``<step>.json``, ``<step>-TAG.json``) as one: items,
    checks and skips together, each call's fields over the earlier ones' where it has items."""
    merged = dict(parts[0])
    for key in ("items", "checks", "skipped"):
        merged[key] = [x for p in parts for x in p.get(key, [])]
    for later in parts[1:]:
        if later.get("items"):
            merged.update({k: v for k, v in later.items() if k not in ("items", "checks",
                                                                       "skipped")})
    merged["ok"] = all(p.get("ok", True) for p in parts)
    merged["elapsed_s"] = sum(p.get("elapsed_s", 0) for p in parts)
    merged["started_at"] = ", ".join(p.get("started_at", "") for p in parts)
    merged["tags"] = [p.get("tag", "") for p in parts]
    return merged


def _load(out: Path) -> dict[str, dict[str, Any]]:
    records = {}
    for step in STEPS:
        parts = [json.loads((out / f"{step}.json").read_text())] \
            if (out / f"{step}.json").exists() else []
        for path in sorted(out.glob(f"{step}-*.json")):  # another call's (--tag), not a copy
            data = json.loads(path.read_text())
            if data.get("tag") and path.name == f"{step}-{data['tag']}.json":
                parts.append(data)
        if parts:
            records[step] = merge(parts)
    return records


def _ms(seconds: float | None, digits: int = 2) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def _mib(n: float | None) -> str:
    return "—" if n is None else f"{n / MiB:.1f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _n(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def headline(records: dict[str, dict[str, Any]]) -> str:
    devices = {r.get("device") for step, r in records.items() if step != "summary"}
    env = next((r["environment"] for r in records.values() if r.get("environment")), {})
    if devices != {"cuda"}:
        return ("**CPU rehearsal (`make gpu DEVICE=cpu QUICK=1`): every figure below was measured "
                f"on the CPU ({env.get('cpu', 'this machine')}) with small models; none is a "
                "GPU result.**")
    return (f"**GPU run on {env.get('gpu', 'a GPU')}** (CUDA {env.get('cuda')}, cuDNN "
            f"{env.get('cudnn')}, driver {env.get('driver')}, torch {env.get('torch')}, commit "
            f"{env.get('commit')}): figures measured on that GPU by `make gpu`.")


def _steps(records: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["## Steps", "", "| step | ran | checks | seconds | skipped |", "|---|---|---|---|---|"]
    for step in STEPS:
        r = records.get(step)
        if r is None:
            lines.append(f"| {step} | not in this run | — | — | — |")
            continue
        checks = r.get("checks", [])
        bad = [c for c in checks if not c["ok"]]
        state = "ok" if r.get("ok") and not bad else f"**{len(bad)} failed**"
        lines.append(f"| {step} | {r.get('started_at', '')} | {state} ({len(checks)}) | "
                     f"{r.get('elapsed_s', 0):.0f} | {len(r.get('skipped', []))} |")
    failed = [(s, c) for s, r in records.items() for c in r.get("checks", []) if not c["ok"]]
    if failed:
        lines += ["", "Failed checks:", ""]
        lines += [f"- {s}: {c['name']}: {c['detail'][:300]}" for s, c in failed]
    skipped = [(s, k) for s, r in records.items() for k in r.get("skipped", [])]
    if skipped:
        lines += ["", "Skipped (the call's deadline, a failed smoke test, or CUDA only):", ""]
        lines += [f"- {s}: {k['what']} ({k['why']})" for s, k in skipped]
    return lines + [""]


def _install(r: dict[str, Any]) -> list[str]:
    d = r.get("device_info") or {}
    return ["## Install", "",
            f"Python {r.get('python_version')} ({r.get('executable')}); "
            f"{'a fresh venv' if r.get('fresh_venv') else 'the machine’s own Python'}; "
            f"{len(r.get('wheels', []))} wheels ({r.get('wheels_mib')} MiB) from "
            f"`{r.get('wheels_dir')}`; timings {r.get('timings')}. torch {d.get('torch')}, CUDA "
            f"available: {d.get('cuda_available')}{', ' + str(d.get('gpu')) if d.get('gpu') else ''}."
            f" Missing requirements: {r.get('missing') or 'none'}; outside pyproject's floors: "
            f"{r.get('outside_floor') or 'none'}; import errors: {r.get('import_errors') or 'none'}.",
            ""]


def _tests(r: dict[str, Any]) -> list[str]:
    lines = ["## Tests", "", "| run | passed | failed | skipped | seconds |", "|---|---|---|---|---|"]
    for item in r["items"]:
        if "passed" in item:
            lines.append(f"| `{item['what']}` | {item['passed']} | {item['failed']} | "
                         f"{item['skipped']} | {item['seconds']:.0f} |")
        else:
            lines.append(f"| `{item['what']}` | {item.get('result', '')} | — | — | "
                         f"{item['seconds']:.0f} |")
    slowest = [t for item in r["items"] for t in item.get("slowest", [])][:8]
    if slowest:
        lines += ["", "Slowest: " + "; ".join(f"`{t['test'].rsplit('.', 1)[-1]}` "
                                              f"({t['seconds']:.0f} s)" for t in slowest)]
    skips = [s for item in r["items"] for s in item.get("skips", [])]
    if skips:
        lines += ["", "Skipped: " + "; ".join(f"`{s['test'].rsplit('.', 1)[-1]}` ({s['reason']})"
                                              for s in skips[:20])]
    return lines + [""]


def _profile(r: dict[str, Any]) -> list[str]:
    lines = ["## Profiling (`vbs profile`)", "",
             "| model | dtype | input | units | B | profile (s) | wall (s) | per sample at b=1 (ms) "
             "| per sample at b=B (ms) | runtime |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["items"]:
        if p.get("rc") != 0:
            lines.append(f"| {p['model']} | {p['dtype']} | failed | | | | {p['wall_s']:.0f} | | | |")
            continue
        shape = "x".join(map(str, p.get("input_shape") or []))
        lines.append(f"| {p['model']} | {p['dtype']} | {shape} | {p['units']} | {p['batch_max']} | "
                     f"{p['profile_s']} | {p['wall_s']:.0f} | {_ms(p['per_sample_b1_s'])} | "
                     f"{_ms(p['per_sample_bmax_s'])} | {p['runtime']} |")
    return lines + ["", "profile (s): the profiler's own time (meta `elapsed_s`); wall: the whole "
                    "`vbs profile`, with loading and capturing the model.", ""]


def _graphs(r: dict[str, Any]) -> list[str]:
    lines = ["## The whole model as one CUDA graph, against eager (`python -m bench.graph_pass`)",
             "", "| model | dtype | samples | eager (ms) | graph (ms) | graph vs eager | max "
             "abs error | within tolerance | graph keeps (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for g in r["items"]:
        if "eager" not in g:
            lines.append(f"| {g['model']} | {g['dtype']} | failed: {g.get('error', '')[-120:]} "
                         "| | | | | | |")
            continue
        graph = g.get("graph")
        lines.append(
            f"| {g['model']} | {g['dtype']} | {g['samples']} | {g['eager']['median_ms']:.3f} "
            f"(±{100 * g['eager']['spread']:.0f}%) | "
            + (f"{graph['median_ms']:.3f} (±{100 * graph['spread']:.0f}%) | "
               f"{g['speedup']:.2f}x | {g['max_abs_error']:.3g} | {g['within_tolerance']} | "
               f"{_mib(g['graph_held_bytes'])} |" if graph else
               f"{g.get('graph_unavailable', '—')} | | | | |"))
    return lines + [""]


def graphs_against_eager(done: list[dict[str, Any]]) -> list[str]:
    """Where a model and dtype ran with a runtime of calls (CUDA graphs, or ONNX Runtime in
    the CPU rehearsal) and eager alone: vbs over fbs-best in each, and what the runtime of
    calls bought fbs-best itself (fbs-best at its own best speed, over all budgets, against
    eager fbs-best at its): where the gain went once launches stopped costing."""
    by = {(b["model"], b["dtype"], b.get("runtime", "torch")): b for b in done}
    lines = ["### With a runtime of calls beside eager", "",
             "| model | dtype | runtime | vbs vs fbs-best (min-max) | eager: vbs vs fbs-best "
             "(min-max) | fbs-best at its best with it vs eager (ms per sample) |",
             "|---|---|---|---|---|---|"]
    for (model, dtype, runtime), b in sorted(by.items()):
        eager = by.get((model, dtype, "torch"))
        if runtime == "torch" or eager is None:
            continue

        def span(item: dict[str, Any]) -> str:
            g = [row["gain_over_fbs_best"] for row in item["rows"]
                 if row["strategy"] == "vbs" and row.get("gain_over_fbs_best")]
            return f"{min(g):.2f}-{max(g):.2f}x" if g else "—"

        def fastest(item: dict[str, Any]) -> float | None:
            times = [row["time_per_sample_measured"] for row in item["rows"]
                     if row["strategy"] == "fbs-best" and row.get("time_per_sample_measured")]
            return min(times) if times else None

        mine, theirs = fastest(b), fastest(eager)
        lines.append(f"| {model} | {dtype} | {runtime} | {span(b)} | {span(eager)} | "
                     + (f"{theirs / mine:.2f}x ({_ms(mine, 3)} against {_ms(theirs, 3)}) |"
                        if mine and theirs else "— |"))
    return lines + [""]


def _bench(r: dict[str, Any]) -> list[str]:
    from workers.plans_measured import markdown

    done = [b for b in r["items"] if "summary" in b]
    lines = ["## Every strategy at every budget (`vbs bench`)", "",
             "| model | dtype | budgets (MiB) | runs | over budget | time MAPE (%) | claimed peak = "
             "measured | peak MAPE (%) | vbs vs fbs, max | vbs vs fbs-best, max | --runtime | "
             "runtimes run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in done:
        s, g = b["summary"], b["gains"]
        budgets = sorted({row["memory_budget"] for row in b["rows"]})

        def gain(base: str) -> str:
            x = g.get(base)
            return "—" if not x else f"{x['gain']:.2f}x at {_mib(x['budget'])} MiB"

        lines.append(f"| {b['model']} | {b['dtype']} | {_mib(budgets[0])}-{_mib(budgets[-1])} | "
                     f"{s['runs']} | {s['budget_exceeded']} | {_pct(s['time_mape'])} | "
                     f"{s['claimed_equals_measured']} of {s['runs']} | {_pct(s['peak_mape'])} | "
                     f"{gain('fbs')} | {gain('fbs-best')} | {b.get('runtime', 'torch')} | "
                     f"{', '.join(b['runtimes'])} |")
    lines += [""] + graphs_against_eager(done)
    lines += ["### Beside the paper's Table II", "",
              f"The paper's columns are its own figures ({CITATION}), not ours: another GPU, "
              "another PyTorch, and budgets of 15-40 MB, where ours run from where fbs-best runs "
              "one sample to where fbs runs the whole request. Both state the largest reduction "
              "of time per sample of VBS over FBS (the largest uniform batch that fits); ours are "
              "measured, and the last column is against fbs-best, the tuned uniform batch.", "",
              "| model | ours: vbs vs fbs, max reduction (%) | ours: vs fbs-best (%) | paper's "
              "network | paper, memory < 30 MB (%) | paper, memory > 35 MB (%) |",
              "|---|---|---|---|---|---|"]
    for model, (name, low, high) in TABLE_II.items():
        ours = [b for b in done if b["model"] == model]
        fbs = ", ".join(f"{b['gains']['fbs']['reduction_pct']:.1f} ({b['dtype']}, "
                        f"{b.get('runtime', 'torch')})" for b in ours
                        if b["gains"].get("fbs")) or "—"
        best = ", ".join(f"{b['gains']['fbs-best']['reduction_pct']:.1f} ({b['dtype']}, "
                         f"{b.get('runtime', 'torch')})"
                         for b in ours if b["gains"].get("fbs-best")) or "—"
        lines.append(f"| {model} | {fbs} | {best} | {name} | {low:.2f} | {high:.2f} |")
    lines += ["", "### Per model", ""]
    for b in done:
        if b["summary"]["runs"]:
            lines += [f"dtype {b['dtype']}, --runtime {b.get('runtime', 'torch')}:", "",
                      markdown({"summary": b["summary"], "rows": b["rows"]})]
    failed = [b for b in r["items"] if "summary" not in b]
    lines += [f"- {b['label']}: failed: {b.get('error', '')[-300:]}" for b in failed]
    return lines + [""]


def _energy(r: dict[str, Any]) -> list[str]:
    lines = ["## Planned for energy beside planned for time", ""]
    for e in r["items"]:
        if "rows" not in e:
            lines += [f"- {e['label']}: failed: {e.get('error', '')}", ""]
            continue
        joules = e["unit"] == "J"
        unit, scale = ("mJ", 1e3) if joules else ("cpu-ms", 1e3)
        m = e["energy_meta"]
        lines += [f"### {e['label']} (r = {e['batch']})", "",
                  f"Counter: {e['counter']}; tick {m['tick_s'] * 1e3:.2f} ms, window "
                  f"{m['window_s'] * 1e3:.0f} ms, batch sizes {m['batch_sizes_measured']}; "
                  f"energy measured in {m['elapsed_s']} s (profile {e['profile_s']} s)."
                  + ("" if joules else " **Not energy: the CPU has no energy counter here, so the "
                     "rehearsal counts CPU-seconds through the same meter.**"), "",
                  f"| budget (MiB) | planned for time: ms / {unit} per sample, measured (predicted) "
                  f"| planned for energy: ms / {unit} per sample, measured (predicted) | fbs-best | "
                  "same plan |", "|---|---|---|---|---|"]

        def cell(c: dict[str, Any]) -> str:
            if not c.get("feasible"):
                return "infeasible"
            return (f"{_ms(c['time_per_sample_measured'])} / "
                    f"{c['energy_per_sample_measured'] * scale:.3f} "
                    f"({_ms(c['time_per_sample_predicted'])} / "
                    f"{c['energy_per_sample_predicted'] * scale:.3f})")

        for row in e["rows"]:
            p = row["plans"]
            lines.append(f"| {_mib(row['budget'])} | {cell(p.get('time', {}))} | "
                         f"{cell(p.get('energy', {}))} | {cell(p.get('fbs-best', {}))} | "
                         f"{'yes' if row['same_plan'] else 'no'} |")
        lines.append("")
    return lines


def _client_cpu(load: dict[str, Any]) -> str:
    """The load generator's own CPU: it shows the clients were not the limit."""
    per, cores = load.get("client_cpu_ms_per_request"), load.get("client_cores")
    return "—" if per is None or cores is None else f"{per:.2f}, {cores:.2f}"


def _served_row(one: dict[str, Any]) -> str:
    load, m, seen = one.get("load") or {}, one.get("metrics") or {}, one.get("over_time") or {}
    peaks = seen.get("plan_peaks_seen") or []
    return (f"| {one['solver']} | {load.get('ok', '—')} | {load.get('errors', '—')} | "
            f"{load.get('throughput_samples_per_s', 0):.1f} | {_ms(load.get('latency_p50_s'), 1)} | "
            f"{_ms(load.get('latency_p99_s'), 1)} | {_n(m.get('oom_retries'))} | "
            f"{_n(m.get('batch_splits'))} | {_n(m.get('rejected'))} | "
            f"{_n(m.get('requests_5xx'))} | {len(peaks)}: "
            f"{_mib(peaks[0]) if peaks else '—'}-{_mib(peaks[-1]) if peaks else '—'} | "
            f"{_client_cpu(load)} | {one.get('service_rc')} |")


def _moving_row(one: dict[str, Any], predicted: dict[str, Any]) -> str:
    mv = one.get("moving") or {}
    load, seen, hog = mv.get("load") or {}, mv.get("over_time") or {}, mv.get("hog") or {}
    levels = ", ".join(_mib(st["size"]) for st in hog.get("steps", []) if st.get("size"))
    settled = ", ".join(_mib(p) if p else "—" for p in mv.get("settled_peaks", []))
    peaks = seen.get("plan_peaks_seen") or []
    guess = predicted.get(one["solver"]) or {}
    return (f"| {one['solver']} | {levels or '—'} | {settled or '—'} | "
            f"**{mv.get('distinct_settled', 0)}** | {len(peaks)}: "
            f"{', '.join(_mib(p) for p in peaks[:12])} | "
            f"{_mib(seen.get('free_min'))}-{_mib(seen.get('free_max'))} | {load.get('ok', '—')} | "
            f"{load.get('errors', '—')} | {load.get('throughput_samples_per_s', 0):.1f} | "
            f"{'yes' if guess.get('ok') else 'no'} ({guess.get('distinct', '—')}) |")


def _serve(r: dict[str, Any]) -> list[str]:
    limit = r.get("limit") or {}
    best = limit.get("best") or {}
    served = [one for one in r["items"] if "solver" in one]
    lines = ["## The service under load, then while another process gives memory back", "",
             f"`vbs serve` ({r.get('model')}, {r.get('clients')} requests in flight x "
             f"{r.get('samples')} sample(s) from {r.get('load_processes', 1)} client "
             f"process(es), {r.get('load', 'closed loop')}, {r.get('duration_s')} s, margin "
             f"{r.get('margin')}, VBS_DEVICE_CACHE_IDLE_S {r.get('idle_s')}) with plans' budget "
             f"{_mib(limit.get('limit'))} MiB (`--memory-limit` {_mib(r.get('memory_limit'))} "
             f"MiB): {limit.get('rule', 'where the tables predict the largest gain')}; predicted "
             f"gain of vbs over fbs-best there {limit.get('predicted_gain', 0):.2f}x (the best "
             f"anywhere: {best.get('gain', 0):.2f}x at {_mib(best.get('budget'))} MiB).", "",
             "Steady (nothing else on the device):", "",
             "| tables | answered | errors | samples/s | p50 (ms) | p99 (ms) | OOM retries | "
             "splits | rejected | 5xx | plan peaks seen (MiB) | clients' CPU (ms/request, "
             "cores) | exit |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_served_row(one) if one.get("ready") else
              f"| {one['solver']} | not ready | | | | | | | | | | | |" for one in served]
    moving = [one for one in served if one.get("moving")]
    if moving:
        lines += ["", "While the hog gives memory back (it started first, after the service's "
                  "cache was given back; OOM retries and the rest above count both windows):", "",
                  "| tables | hog's steps (MiB; it leaves them on CUDA, takes them on the "
                  "CPU) | settled plan peak per step (MiB) | distinct | "
                  "plan peaks seen (MiB) | memory free seen (MiB) | answered | errors | "
                  "samples/s | reach.py predicted (distinct) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_moving_row(one, r.get("reach") or {}) for one in moving]
    lines += _serve_ratios(r)
    if r.get("device") != "cuda":
        lines += ["", "On the CPU the hog's memory does not count against the service's limit "
                  "(no cgroup joins the two processes here), so the plans are not expected to "
                  "move in this rehearsal; on CUDA both share the device's free memory."]
    return lines + [""]


def served_ratios(r: dict[str, Any]) -> dict[str, float | None]:
    """The served samples/s of vbs's tables over fbs-best's, and over the same plans offline."""
    rates = {one["solver"]: (one.get("load") or {}).get("throughput_samples_per_s")
             for one in r.get("items", []) if "solver" in one}
    offline = next((one for one in r.get("items", []) if one.get("what") == "offline"), {})
    vbs, best, alone = rates.get("vbs"), rates.get("fbs-best"), offline.get("vbs_samples_per_s")
    return {"vbs": vbs, "fbs_best": best, "offline": alone,
            "over_fbs_best": vbs / best if vbs and best else None,
            "over_offline": vbs / alone if vbs and alone else None}


def _serve_ratios(r: dict[str, Any]) -> list[str]:
    x = served_ratios(r)
    lines = []
    if x["over_fbs_best"]:
        lines += ["", f"Served with vbs's tables: {x['over_fbs_best']:.2f}x the samples per "
                  "second of fbs-best's, at the same limit and load."]
    if x["offline"]:
        lines += ["", f"The same plans offline (`vbs bench` at the budget, a full batch): vbs "
                  f"{x['offline']:.1f} samples/s"
                  + (f"; served: {x['over_offline']:.2f}x of that." if x["over_offline"] else ".")]
    shots = next((one for one in r.get("items", []) if one.get("what") == "snapshots"), None)
    if shots:
        lines += ["", f"The allocator's snapshots: {shots.get('file') or shots.get('skipped')}"
                  + (f" ({', '.join(shots['dumps'])})" if shots.get("dumps") else "") + "."]
    return lines


def _smoke(r: dict[str, Any]) -> list[str]:
    lines = ["## Smoke test: CUDA graphs in the bench's and the profiler's orders", ""]
    for item in r["items"]:
        if item.get("skipped"):
            lines.append(f"Skipped: {item['skipped']}.")
            continue
        lines += [f"{item.get('model')} at {item.get('shape')}: "
                  f"{'passed' if item.get('ok') else 'FAILED'} in {item.get('wall_s', 0):.0f} s.",
                  ""]
        lines += [f"- {st['name']}: {'ok' if st['ok'] else 'FAILED: ' + st['error'][:300]} "
                  f"({st['seconds']} s)" for st in item.get("stages", [])]
    return lines + [""]


def write(out: Path, name: str = "summary.md") -> Path:
    """summary.md (or ``name``) from the records in ``out``."""
    records = _load(out)
    lines = [headline(records), "", "Made by `make gpu` (bench/gpu/); the device calls are in "
             "docs/gpu.md. Every figure comes from the JSON records beside this file.", ""]
    lines += _steps(records)
    lines += done.done_when(records, served_ratios(records.get("serve") or {}))
    sections = {"install": _install, "smoke": _smoke, "tests": _tests, "profile": _profile,
                "graphs": _graphs, "bench": _bench, "serve": _serve, "energy": _energy}
    for step, render in sections.items():
        if step in records:
            try:
                lines += render(records[step])
            except (KeyError, TypeError, ValueError) as exc:  # a partial record: say so, go on
                lines += [f"## {step}", "", f"(the record could not be summarised: {exc!r})", ""]
    path = out / name
    path.write_text("\n".join(lines))
    return path
