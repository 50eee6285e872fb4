"""Step ``serve``: `vbs serve` under `vbs loadtest`, with vbs's tables and with fbs-best's at the
same memory limit, while bench/memory_hog.py takes and frees memory beside it.

The load is `vbs loadtest`'s client processes (``service.loadgen``): ``load_processes()`` of
them, a closed loop of ``concurrency()`` requests in flight (twice the largest batch, or the
configured clients if more), OIP v2 with binary tensors over HTTP, encoded once; each row
carries the clients' own CPU (ms a request and cores) beside the served figures.

`vbs plan` fills a directory store once (every strategy's table); the limit is the budget where
the tables predict vbs's largest gain over fbs-best for a full batch. Then, per strategy: the
service starts with that limit, the load test runs, the hog starts after the load's warm-up,
/metrics is read every half second (the memory free and the peak of the plan each batch ran:
plans stepping down) and at the end (OOM retries, splits, samples, rejections), and the service
is stopped with SIGINT (it drains). Nothing may be lost: every request answered 200, nothing
rejected. On CUDA the hog shares the device with the service; on the CPU nothing joins the
two processes' memory (no cgroup here), so step-downs and OOM retries are not expected there.
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

from bench.gpu.config import Config
from bench.gpu.record import ROOT, VBS, Deadline, Record, run

SOLVERS = ("vbs", "fbs-best")
READY_TIMEOUT_S = 240.0


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


def choose_limit(store: Path, model: str, batch: int) -> dict[str, Any]:
    """The budget where the stored tables predict vbs's largest gain over fbs-best for
    ``batch`` samples (the smallest such), with the candidates."""
    from core.errors import InfeasibleError
    from planner.solver.compare import budget_range
    from core.sizes import parse_budgets
    from core.table import PlanTable
    from planner.store import open_store

    st = open_store(str(store))
    try:
        tables = {}
        for info in st.list_tables():
            if info.meta.get("model") == model and info.meta.get("objective") == "time":
                tables[info.meta["solver"]] = PlanTable.from_bytes(st.get_table(info.fingerprint).blob,
                                                                   info.fingerprint)
    finally:
        st.close()
    candidates = []
    for budget in parse_budgets("auto:8", *budget_range(tables, batch)):
        try:
            vbs, best = (tables[s].lookup(batch, budget).time_per_sample for s in SOLVERS)
        except InfeasibleError:
            continue
        candidates.append({"budget": budget, "gain": best / vbs, "vbs_s": vbs, "fbs_best_s": best})
    chosen = max(candidates, key=lambda c: (round(c["gain"], 3), -c["budget"]))
    top = tables["vbs"].row(batch).peaks[-1]
    return {"limit": chosen["budget"], "predicted_gain": chosen["gain"], "candidates": candidates,
            "vbs_top_bytes": int(top), "fbs_best_min_bytes": int(tables["fbs-best"].min_peaks[0])}


def concurrency(cfg: Config) -> int:
    """Requests in flight: enough to fill the largest batch twice over."""
    return max(cfg.serve.clients, 2 * cfg.serve.run.batch_max)


def load_processes(cfg: Config) -> int:
    """Client processes: a quarter of this machine's CPUs, 2 to 4 (never more than in flight)."""
    return min(concurrency(cfg), max(2, min(4, (os.cpu_count() or 2) // 4)))


def hog_args(spec: tuple[str, ...], limit: int) -> list[str]:
    """The hog's arguments, sizes written ``Nx`` (N times the limit) made bytes."""
    def size(token: str) -> str:
        return str(int(float(token[:-1]) * limit)) if token.endswith("x") else token
    return [",".join(size(t) for t in arg.split(",")) if not arg.startswith("--") else arg
            for arg in spec]


class Sampler(threading.Thread):
    """Reads /metrics every ``period_s``: the memory free and the last plan's peak over time."""

    def __init__(self, url: str, model: str, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.period_s = url, model, period_s
        self.points: list[tuple[float, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.period_s):
            status, text = get(self.url + "/metrics")
            if status == 200:
                page = samples(text)
                self.points.append((round(time.monotonic() - t0, 2),
                                    total(page, "vbs_free_memory_bytes", model=self.model),
                                    total(page, "vbs_plan_peak_bytes", model=self.model)))


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
    """The sampler's free memory and plan peaks while the load ran."""
    peaks = sorted({int(p) for _, _, p in points if p > 0})
    return {"readings": len(points), "plan_peaks_seen": peaks,
            "free_min": min((f for _, f, _ in points), default=None),
            "free_max": max((f for _, f, _ in points), default=None),
            "points": points[:400]}


def _serve_one(cfg: Config, work: Path, solver: str, limit: int, deadline: Deadline) -> dict[str, Any]:
    s = cfg.serve
    item = s.run
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"serve-{solver}.log"
    cmd = [*VBS, "serve", "--model", item.entry, "--store", str(work / "store"),
           "--batch-max", str(item.batch_max), "--device", cfg.device, "--dtype", item.dtype,
           "--runtime", cfg.runtime, "--solver", solver, "--memory-limit", str(limit),
           "--memory-margin", s.margin, "--port", str(port), "--grpc-port", "0",
           "--log-level", "warning"]
    env = {**os.environ, **cfg.vbs_env(work), "PYTHONUNBUFFERED": "1"}
    out: dict[str, Any] = {"solver": solver, "limit": limit, "port": port}
    with open(log, "w") as logf:
        service = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
        hog = None
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
            hog_out = work / f"hog-{solver}.json"
            hog = subprocess.Popen([sys.executable, str(ROOT / "bench" / "memory_hog.py"),
                                    "--device", cfg.device, *hog_args(s.hog, limit),
                                    "--hold-s", str(s.hold_s), "--gap-s", str(s.gap_s),
                                    "--delay-s", str(s.warmup_s), "--duration-s", str(s.duration_s),
                                    "--out", str(hog_out)], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            sampler = Sampler(url, item.model)
            sampler.start()
            load = run([*VBS, "loadtest", "--url", url, "--model", item.model,
                        "--processes", str(load_processes(cfg)),
                        "--concurrency", str(concurrency(cfg)), "--samples", str(s.samples),
                        "--duration", str(s.duration_s), "--warmup", str(s.warmup_s), "--json"],
                       timeout_s=s.duration_s + s.warmup_s + 120)
            sampler.stop.set()
            sampler.join(5)
            out["load"] = _load_summary(load.output)
            if out["load"] is None:
                out["load_error"] = load.tail(1500)
            else:
                out["client_cpu"] = {k: out["load"].get(k) for k in (
                    "processes", "client_cpu_ms_per_request", "client_cores")}
            hog_rc = hog.wait(timeout=s.duration_s + s.warmup_s + 60)
            out["hog"] = json.loads(hog_out.read_text()) if hog_out.exists() else \
                {"rc": hog_rc, "error": (hog.stderr.read() if hog.stderr else "")[-1000:]}
            out["hog"].pop("log", None)
            out["metrics"] = _served_figures(url, item.model)
            out["over_time"] = _over_time(sampler.points)
        finally:
            if hog is not None and hog.poll() is None:
                hog.terminate()
                hog.wait(10)
            if service.poll() is None:
                service.send_signal(signal.SIGINT)
                try:
                    service.wait(45)
                except subprocess.TimeoutExpired:
                    service.kill()
                    service.wait(10)
            out["service_rc"] = service.returncode
    text = log.read_text(errors="replace")
    out["log_retries"] = text.count("with a smaller plan")
    out["log_tail"] = text[-1500:]
    return out


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    s = cfg.serve
    item = s.run
    if not deadline.allows(item.estimate_s):
        rec.skip(f"serve {item.label}", f"{deadline.left():.0f} s left of the call")
        return
    store = work / "store"
    planned = run([*VBS, "plan", "--model", item.entry, "--batch-max", str(item.batch_max),
                   "--store", str(store), "--device", cfg.device, "--dtype", item.dtype,
                   "--runtime", cfg.runtime, "--quiet"],
                  timeout_s=deadline.left(), env=cfg.vbs_env(work))
    if not rec.check(f"vbs plan {item.label}", planned.ok, planned.tail(400)):
        return
    limit = choose_limit(store, item.model, item.batch_max)
    rec.set(limit=limit, model=item.label, clients=concurrency(cfg), samples=s.samples,
            load_processes=load_processes(cfg), load="closed loop, OIP v2 binary over HTTP",
            duration_s=s.duration_s, margin=s.margin, plan_s=planned.seconds)
    for solver in SOLVERS:
        if not deadline.allows(item.estimate_s / 2):
            rec.skip(f"serve {solver}", f"{deadline.left():.0f} s left of the call")
            continue
        one = _serve_one(cfg, work, solver, limit["limit"], deadline)
        rec.item(one)
        load, metrics = one.get("load") or {}, one.get("metrics") or {}
        rec.check(f"serve {solver}: ready", bool(one.get("ready")), one.get("log_tail", "")[-400:])
        if not one.get("ready"):
            continue
        rec.check(f"serve {solver}: requests answered", load.get("ok", 0) > 0,
                  one.get("load_error", "")[-300:])
        lost = (load.get("errors", 1), metrics.get("rejected", 1), metrics.get("requests_5xx", 1))
        rec.check(f"serve {solver}: nothing lost", lost == (0, 0, 0),
                  f"load errors {lost[0]} ({load.get('errors_by_status')}), rejected {lost[1]}, "
                  f"5xx {lost[2]}")
        rec.check(f"serve {solver}: every counted sample served",
                  metrics.get("samples", 0) >= load.get("ok", 0) * s.samples,
                  f"served {metrics.get('samples')}, load test counted {load.get('ok')}")
        rec.check(f"serve {solver}: the hog took memory", (one.get("hog") or {}).get("cycles", 0) > 0,
                  json.dumps(one.get("hog"))[:300])
        if cfg.device.startswith("cuda"):
            # the service gives its allocator's cache back (workers/device_cache.py), so the
            # hog's cycles move its reading: plans at three or more budgets (on the CPU the
            # hog is not in the service's group: nothing to follow)
            peaks = (one.get("over_time") or {}).get("plan_peaks_seen", [])
            rec.check(f"serve {solver}: plans followed the hog", len(peaks) >= 3,
                      f"plan peaks seen: {peaks}")
        # uvicorn drains, then raises the signal it caught again: 130 is the drained exit
        rec.check(f"serve {solver}: stopped on SIGINT", one.get("service_rc") in (0, 130),
                  f"exit {one.get('service_rc')}")
