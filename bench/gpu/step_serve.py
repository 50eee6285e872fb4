"""Step ``serve``: `vbs serve` under `vbs loadtest`, with vbs's tables and with fbs-best's at the
same memory limit, then with a second process (bench/memory_hog.py) giving memory back in steps.

The load is `vbs loadtest`'s client processes: ``load_processes()`` of them, a closed loop of
``concurrency()`` requests in flight (twice the largest batch, or the configured clients if
more), OIP v2 with binary tensors over HTTP, encoded once; each load reports the clients' CPU.

`vbs plan` fills a directory store once. The plans' budget is where the tables still predict a
large gain of vbs over fbs-best for a full batch, at least ``pages`` large pages (``reach.py``:
below the limit the reading moves in whole pages, and under a page it cannot move at all);
``--memory-limit`` is the budget plus the margin. Per solver, the service starts with it and
runs a steady window (samples/s at the limit, nothing else on the device). For the tables the
hog moves, the device then idles past the service's ``idle_s`` (its allocator's cache given
back: a cache that covers the limit pins the reading), the hog takes all but the first step's
memory, and a second load runs while it gives memory back step by step, /metrics read every
half second. Before it runs, ``reach.reachable`` says whether this design can show ``k``
distinct plan peaks (recorded). Then the same plans offline (`vbs bench` at the budget), and on
CUDA the allocator's segments at three moments (bench/gpu/snapshots.py; $OUT/records). Nothing
may be lost: every request answered 200, nothing rejected. On the CPU nothing joins the hog's
memory to the service's (no cgroup), so the plans are not expected to move there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.gpu import reach
from bench.gpu.config import Config
from bench.gpu.record import ROOT, VBS, Deadline, Record, publish, run, tagged

SOLVERS = ("vbs", "fbs-best")
READY_TIMEOUT_S = 240.0
GRID = "auto:24"  # candidate budgets between fbs-best's least and fbs's whole request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(page: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in page if n == name and all(lab.get(k) == w for k, w in labels.items()))


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.status, answer.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, str(exc)


def tables_of(store: Path, model: str) -> dict[str, Any]:
    """Every solver's time table of ``model`` in the store."""
    from core.table import PlanTable
    from planner.store import open_store

    st = open_store(str(store))
    try:
        return {info.meta["solver"]: PlanTable.from_bytes(st.get_table(info.fingerprint).blob,
                                                          info.fingerprint)
                for info in st.list_tables()
                if info.meta.get("model") == model and info.meta.get("objective") == "time"}
    finally:
        st.close()


def choose_limit(tables: dict[str, Any], batch: int, floor: int, within: float
                 ) -> dict[str, Any]:
    """The plans' budget (``reach.pick_limit`` over the tables' predictions for ``batch``
    samples), with the candidates and the rule that chose it."""
    from core.errors import InfeasibleError
    from core.sizes import parse_budgets
    from planner.solver.compare import budget_range

    candidates = []
    for budget in parse_budgets(GRID, *budget_range(tables, batch)):
        try:
            vbs, best = (tables[s].lookup(batch, budget).time_per_sample for s in SOLVERS)
        except InfeasibleError:
            continue
        candidates.append({"budget": budget, "gain": best / vbs, "vbs_s": vbs, "fbs_best_s": best})
    picked = reach.pick_limit(candidates, floor=floor, within=within)
    chosen = picked["chosen"]
    return {"limit": chosen["budget"], "predicted_gain": chosen["gain"], "rule": picked["rule"],
            "floor": floor, "best": picked["best"], "grid": GRID, "candidates": candidates,
            "vbs_top_bytes": int(tables["vbs"].row(batch).peaks[-1]),
            "fbs_best_min_bytes": int(tables["fbs-best"].min_peaks[0])}


def concurrency(cfg: Config) -> int:
    """Requests in flight: enough to fill the largest batch twice over."""
    return max(cfg.serve.clients, 2 * cfg.serve.run.batch_max)


def load_processes(cfg: Config) -> int:
    """Client processes: a quarter of this machine's CPUs, 2 to 4 (never more than in flight)."""
    return min(concurrency(cfg), max(2, min(4, (os.cpu_count() or 2) // 4)))


def levels(cfg: Config, memory_limit: int, margin: int) -> list[int]:
    """What the hog leaves the service at each step (its cache included: it was given back):
    the margin, and a share of what plans may use."""
    return [margin + int(f * (memory_limit - margin)) for f in cfg.serve.steps]


def hog_cmd(cfg: Config, steps: list[int], memory_limit: int, out: Path, ready: Path
            ) -> list[str]:
    """bench/memory_hog.py in steps: on CUDA all free memory but each level; on the CPU (no
    device to leave memory on) the limit less each level, under the hog's cap."""
    s = cfg.serve
    if cfg.device == "cuda":
        sizes = ["--leave-steps", ",".join(map(str, steps))]
    else:
        sizes = ["--take-steps", ",".join(str(max(1, memory_limit - v)) for v in steps)]
    return [sys.executable, str(ROOT / "bench" / "memory_hog.py"), "--device", cfg.device, *sizes,
            "--memory-limit", s.hog_cap, "--hold-s", str(s.hold_s), "--lead-s", str(s.lead_s),
            "--ready", str(ready), "--out", str(out)]


def predict(cfg: Config, breakpoints: dict[str, list[int]], memory_limit: int, margin: int
            ) -> dict[str, Any]:
    """``reach.reachable`` of the moving window, per table the hog moves (``breakpoints``: its
    row's peaks at a full batch): the hog's steps on a service whose cache was given back, a
    closed loop."""
    s = cfg.serve
    phases = reach.staircase(levels(cfg, memory_limit, margin), s.hold_s, s.tail_s)
    phases[0] = reach.Phase(s.hold_s + s.lead_s, leave=phases[0].leave)
    return {solver: reach.reachable(limit=memory_limit, margin=margin, k=s.k, phases=phases,
                                    breakpoints=breakpoints[solver], cache=0,
                                    load=reach.Load(idle_s=s.idle_s)).as_dict()
            for solver in s.moving}


class Sampler(threading.Thread):
    """Reads /metrics every ``period_s``: (monotonic time, memory free, the last plan's peak,
    samples served so far); a point whose samples did not move shows an old plan."""

    def __init__(self, url: str, model: str, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.period_s = url, model, period_s
        self.points: list[tuple[float, float, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            status, text = get(self.url + "/metrics")
            if status == 200:
                page = samples(text)
                self.points.append((round(time.monotonic(), 2),
                                    total(page, "vbs_free_memory_bytes", model=self.model),
                                    total(page, "vbs_plan_peak_bytes", model=self.model),
                                    total(page, "vbs_samples_total", model=self.model)))

    def fresh(self) -> list[tuple[float, float, float]]:
        """The points read after plans ran since the one before: (time, free, peak)."""
        pts = self.points
        return [(t, f, p) for i, (t, f, p, n) in enumerate(pts) if i and n > pts[i - 1][3]]


def _load_summary(output: str) -> dict[str, Any] | None:
    """`vbs loadtest --json`'s summary, after any warning it printed first; None if absent."""
    start = re.search(r"^\{$", output, re.M)
    try:
        return json.loads(output[start.start():]) if start else None
    except ValueError:
        return None


def _served_figures(url: str, m: str) -> dict[str, Any]:
    """What the service's /metrics counted for model ``m``."""
    status, text = get(url + "/metrics")
    page = samples(text) if status == 200 else []
    return {
        "oom_retries": total(page, "vbs_oom_retries_total", model=m),
        "batch_splits": total(page, "vbs_batch_splits_total", model=m),
        "samples": total(page, "vbs_samples_total", model=m),
        "rejected": total(page, "vbs_rejected_total", model=m),
        "step_downs": total(page, "vbs_memory_step_downs_total", model=m),
        "lease_waits": total(page, "vbs_memory_lease_waits_total", model=m),
        # inference answers only: the readiness poll's 503s before the tables are in
        # are the probe working, not a request lost
        "requests_5xx": sum(v for n, lab, v in page if n == "vbs_requests_total"
                            and lab.get("endpoint") != "health"
                            and lab.get("status", "").startswith("5")),
        "requests_4xx": sum(v for n, lab, v in page if n == "vbs_requests_total"
                            and lab.get("status", "").startswith("4")),
        "errors_by_label": [dict(lab, count=v) for n, lab, v in page
                            if n == "vbs_requests_total" and v
                            and lab.get("status", "")[:1] in ("4", "5")],
    }


def _over_time(points: list[tuple[float, float, float]]) -> dict[str, Any]:
    """The sampler's fresh points: memory free and plan peaks while a load ran."""
    peaks = sorted({int(p) for _, _, p in points if p > 0})
    return {"readings": len(points), "plan_peaks_seen": peaks,
            "free_min": min((f for _, f, _ in points), default=None),
            "free_max": max((f for _, f, _ in points), default=None),
            "points": points[:400]}


def _load(cfg: Config, url: str, duration_s: float, warmup_s: float) -> dict[str, Any]:
    """One `vbs loadtest` against the service, with the sampler's fresh points beside it."""
    s = cfg.serve
    sampler = Sampler(url, s.run.model)
    sampler.start()
    ran = run([*VBS, "loadtest", "--url", url, "--model", s.run.model,
               "--processes", str(load_processes(cfg)), "--concurrency", str(concurrency(cfg)),
               "--samples", str(s.samples), "--duration", str(duration_s),
               "--warmup", str(warmup_s), "--json"], timeout_s=duration_s + warmup_s + 120)
    sampler.stop.set()
    sampler.join(5)
    out: dict[str, Any] = {"load": _load_summary(ran.output), "sampled": sampler.points[:400],
                           "over_time": _over_time(sampler.fresh()),
                           "ended_at": round(time.monotonic(), 2)}
    if out["load"] is None:
        out["load_error"] = ran.tail(1500)
    else:
        out["client_cpu"] = {k: out["load"].get(k) for k in (
            "processes", "client_cpu_ms_per_request", "client_cores")}
    return out


def _moving(cfg: Config, work: Path, solver: str, url: str, memory_limit: int, margin: int
            ) -> dict[str, Any]:
    """The hog first, the load after it: the device idles past ``idle_s`` (the service's cache
    given back), the hog takes all but the first step, the load runs while it gives back."""
    s = cfg.serve
    time.sleep(1.5 * s.idle_s + 0.5)  # the idle thread has given the cache back
    ready, report = work / f"hog-{solver}.ready", work / f"hog-{solver}.json"
    ready.unlink(missing_ok=True)
    steps = levels(cfg, memory_limit, margin)
    env = {**os.environ, **cfg.vbs_env(work)}
    hog = subprocess.Popen(hog_cmd(cfg, steps, memory_limit, report, ready), cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not ready.exists() and hog.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        duration = s.lead_s + len(steps) * s.hold_s + s.tail_s
        out = _load(cfg, url, duration, 0.0)
        rc = hog.wait(timeout=duration + 60)
        out["hog"] = json.loads(report.read_text()) if report.exists() else \
            {"rc": rc, "error": (hog.stderr.read() if hog.stderr else "")[-1000:]}
    finally:
        if hog.poll() is None:
            hog.terminate()
            hog.wait(10)
    log = out["hog"].pop("log", None) or []
    starts = [c["t"] for c in log]
    fresh = [tuple(p) for p in out["over_time"]["points"]]
    out["hog"]["steps"] = [{k: c.get(k) for k in ("t", "size", "taken", "free_while_held",
                                                  "error")} for c in log]
    out["settled_peaks"] = reach.settled_peaks(fresh, starts, out["ended_at"]) if starts else []
    out["distinct_settled"] = len({p for p in out["settled_peaks"] if p})
    return out


def _start(cfg: Config, work: Path, solver: str, memory_limit: int, port: int
           ) -> subprocess.Popen[bytes]:
    s = cfg.serve
    item = s.run
    cmd = [*VBS, "serve", "--model", item.entry, "--store", str(work / "store"),
           "--batch-max", str(item.batch_max), "--device", cfg.device, "--dtype", item.dtype,
           "--runtime", cfg.runtime, "--solver", solver, "--memory-limit", str(memory_limit),
           "--memory-margin", s.margin, "--port", str(port), "--grpc-port", "0",
           "--log-level", "warning"]
    env = {**os.environ, **cfg.vbs_env(work), "PYTHONUNBUFFERED": "1",
           "VBS_DEVICE_CACHE_IDLE_S": str(s.idle_s)}
    log = open(work / f"serve-{solver}.log", "w")  # noqa: SIM115 - the child writes it
    try:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _stop(service: subprocess.Popen[bytes]) -> int | None:
    """SIGINT (the service drains), then kill if it lingers."""
    if service.poll() is None:
        service.send_signal(signal.SIGINT)
        try:
            service.wait(45)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(10)
    return service.returncode


def _serve_one(cfg: Config, work: Path, solver: str, memory_limit: int, margin: int,
               deadline: Deadline) -> dict[str, Any]:
    """One service: ready, the steady window, the moving one (for ``cfg.serve.moving``)."""
    s = cfg.serve
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"solver": solver, "limit": memory_limit, "port": port}
    service = _start(cfg, work, solver, memory_limit, port)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < min(READY_TIMEOUT_S, deadline.left()):
            if service.poll() is not None or get(url + "/v2/health/ready", 2)[0] == 200:
                break
            time.sleep(0.2)
        out["ready_s"] = round(time.monotonic() - t0, 2)
        out["ready"] = service.poll() is None and get(url + "/v2/health/ready", 2)[0] == 200
        if not out["ready"]:
            return out
        out.update(_load(cfg, url, s.duration_s, s.warmup_s))
        out.pop("sampled", None)
        if solver in s.moving:
            if deadline.allows(s.moving_s):
                out["moving"] = _moving(cfg, work, solver, url, memory_limit, margin)
            else:
                out["moving_skipped"] = f"{deadline.left():.0f} s left of the call"
        out["metrics"] = _served_figures(url, s.run.model)
    finally:
        out["service_rc"] = _stop(service)
    text = (work / f"serve-{solver}.log").read_text(errors="replace")
    out["log_retries"] = text.count("with a smaller plan")
    out["log_tail"] = text[-1500:]
    return out


def _offline(cfg: Config, work: Path, budget: int, deadline: Deadline) -> dict[str, Any]:
    """The served plans offline: `vbs bench` of vbs and fbs-best at the budget, a full batch."""
    s = cfg.serve
    item = s.run
    ran = run([*VBS, "bench", "--model", item.model, *item.shape_arg, "--batch",
               str(item.batch_max), "--batch-max", str(item.batch_max), "--memory", str(budget),
               "--repeat", str(s.offline_repeat), "--device", cfg.device, "--dtype", item.dtype,
               "--runtime", cfg.runtime, "--json"],  # rows only: no pictures drawn
              timeout_s=deadline.left(), env=cfg.vbs_env(work))
    row: dict[str, Any] = {"what": "offline", "budget": budget, "batch": item.batch_max,
                           "rc": ran.rc, "wall_s": ran.seconds}
    start = re.search(r"^\[$", ran.output, re.M)
    try:
        rows = json.loads(ran.output[start.start():]) if ran.ok and start else None
    except ValueError:
        rows = None
    if rows is None:
        return {**row, "error": ran.tail(1500)}
    for r in rows:
        t = r.get("time_per_sample_measured")
        if r["strategy"] in SOLVERS and t:
            row[f"{r['strategy']}_samples_per_s"] = 1.0 / t
            row[f"{r['strategy']}_peak_bytes"] = r.get("peak_bytes_measured")
    return row


def _snapshots(cfg: Config, work: Path, rec: Record, memory_limit: int, margin: int,
               deadline: Deadline) -> dict[str, Any]:
    """bench/gpu/snapshots.py: the allocator's segments after a plan, after the hog took memory,
    after a plan under it; published to $OUT/records/ (CUDA only: it skips on the CPU)."""
    s = cfg.serve
    path = work / tagged("snapshots.json", rec.tag)
    cmd = [sys.executable, "-m", "bench.gpu.snapshots", "--device", cfg.device, "--store",
           str(work / "store"), "--model", s.run.entry, "--dtype", s.run.dtype, "--batch",
           str(s.run.batch_max), "--memory-limit", str(memory_limit), "--margin", str(margin),
           "--leave", str(memory_limit // 2), "--out", str(path)]
    ran = run(cmd, timeout_s=min(deadline.left(), 4 * s.snapshots_s), env=cfg.vbs_env(work))
    done = json.loads(path.read_text()) if path.exists() else {}
    row = {"what": "snapshots", "rc": ran.rc, "wall_s": ran.seconds,
           "skipped": done.get("skipped", ""), "dumps": [d["name"] for d in done.get("dumps", [])],
           "file": f"records/{path.name}" if done.get("dumps") else None}
    if done.get("dumps"):
        publish(path, "records")
    if not ran.ok:
        row["error"] = ran.tail(1500)
    return row


def _check_one(cfg: Config, rec: Record, one: dict[str, Any]) -> None:
    """The checks of one service's record."""
    s = cfg.serve
    solver = one["solver"]
    rec.check(f"serve {solver}: ready", bool(one.get("ready")), one.get("log_tail", "")[-400:])
    if not one.get("ready"):
        return
    load, metrics = one.get("load") or {}, one.get("metrics") or {}
    moving = one.get("moving") or {}
    mload = moving.get("load") or {} if moving else {}
    rec.check(f"serve {solver}: requests answered", load.get("ok", 0) > 0,
              one.get("load_error", "")[-300:])
    errors = load.get("errors", 1) + (mload.get("errors", 1) if moving else 0)
    lost = (errors, metrics.get("rejected", 1), metrics.get("requests_5xx", 1))
    rec.check(f"serve {solver}: nothing lost", lost == (0, 0, 0),
              f"load errors {lost[0]} ({load.get('errors_by_status')}, moving "
              f"{mload.get('errors_by_status')}), rejected {lost[1]}, 5xx {lost[2]}")
    answered = load.get("ok", 0) + mload.get("ok", 0)
    rec.check(f"serve {solver}: every counted sample served",
              metrics.get("samples", 0) >= answered * s.samples,
              f"served {metrics.get('samples')}, load tests counted {answered}")
    if solver in s.moving and "moving_skipped" not in one:
        hog = moving.get("hog") or {}
        rec.check(f"serve {solver}: the hog took memory", hog.get("max_taken", 0) > 0,
                  json.dumps(hog)[:300])
        if cfg.device == "cuda":
            # the hog's steps move the service's reading (nothing joins them on the CPU)
            rec.check(f"serve {solver}: plans followed the hog",
                      moving.get("distinct_settled", 0) >= s.k,
                      f"settled plan peaks per step: {moving.get('settled_peaks')}; all seen: "
                      f"{(moving.get('over_time') or {}).get('plan_peaks_seen')}")
    # uvicorn drains, then raises the signal it caught again: 130 is the drained exit
    rec.check(f"serve {solver}: stopped on SIGINT", one.get("service_rc") in (0, 130),
              f"exit {one.get('service_rc')}")


def _plan_and_limit(cfg: Config, work: Path, rec: Record, deadline: Deadline
                    ) -> tuple[int, int] | None:
    """`vbs plan`, the budget and the limit (recorded, with what reach.py predicts); None when
    the plan failed."""
    from core.sizes import parse_bytes
    from workers.device_cache import LARGE_PAGE

    s = cfg.serve
    item = s.run
    store = work / "store"
    planned = run([*VBS, "plan", "--model", item.entry, "--batch-max", str(item.batch_max),
                   "--store", str(store), "--device", cfg.device, "--dtype", item.dtype,
                   "--runtime", cfg.runtime, "--quiet"],
                  timeout_s=deadline.left(), env=cfg.vbs_env(work))
    if not rec.check(f"vbs plan {item.label}", planned.ok, planned.tail(400)):
        return None
    tables = tables_of(store, item.model)
    limit = choose_limit(tables, item.batch_max, s.pages * LARGE_PAGE, s.within)
    margin = parse_bytes(s.margin)
    memory_limit = limit["limit"] + margin
    rows = {solver: [int(p) for p in tables[solver].row(item.batch_max).peaks]
            for solver in s.moving}
    predicted = predict(cfg, rows, memory_limit, margin)
    rec.set(limit=limit, memory_limit=memory_limit, margin_bytes=margin, page=LARGE_PAGE,
            levels=levels(cfg, memory_limit, margin), reach=predicted, model=item.label,
            clients=concurrency(cfg), samples=s.samples, load_processes=load_processes(cfg),
            load="closed loop, OIP v2 binary over HTTP", duration_s=s.duration_s,
            margin=s.margin, idle_s=s.idle_s, plan_s=planned.seconds)
    if cfg.device == "cuda":  # the design, before the run: a check that cannot pass fails here
        for solver, got in predicted.items():
            rec.check(f"serve {solver}: the hog's steps can move the plans (reach.py)",
                      got["ok"], got["why"] or f"{got['distinct']} distinct peaks predicted")
    return limit["limit"], memory_limit


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    s = cfg.serve
    if not deadline.allows(s.run.estimate_s):
        rec.skip(f"serve {s.run.label}", f"{deadline.left():.0f} s left of the call")
        return
    chosen = _plan_and_limit(cfg, work, rec, deadline)
    if chosen is None:
        return
    budget, memory_limit = chosen
    for solver in SOLVERS:
        need = s.steady_s + (s.moving_s if solver in s.moving else 0)
        if not deadline.allows(need):
            rec.skip(f"serve {solver}", f"{deadline.left():.0f} s left of the call")
            continue
        one = _serve_one(cfg, work, solver, memory_limit, memory_limit - budget, deadline)
        rec.item(one)
        _check_one(cfg, rec, one)
    if deadline.allows(s.offline_s):
        offline = _offline(cfg, work, budget, deadline)
        rec.item(offline)
        rec.check("serve: the same plans offline", "error" not in offline,
                  offline.get("error", "")[-300:])
    else:
        rec.skip("serve: the same plans offline", f"{deadline.left():.0f} s left of the call")
    if deadline.allows(s.snapshots_s):
        shot = _snapshots(cfg, work, rec, memory_limit, memory_limit - budget, deadline)
        rec.item(shot)
        if shot["skipped"]:
            rec.skip("serve: the allocator's snapshots", shot["skipped"])
        rec.check("serve: the allocator's snapshots", bool(shot["dumps"]) if cfg.device == "cuda"
                  else shot["rc"] == 0, shot.get("error", "")[-300:] or shot["skipped"])
    else:
        rec.skip("serve: the allocator's snapshots", f"{deadline.left():.0f} s left of the call")
