"""Step ``tests``: the tests marked ``gpu``, then the core, planner and workers suites.

On CUDA every ``gpu`` test must pass and none may be skipped (a skip there means a GPU path did
not run). The rehearsal on the CPU collects them and the suites only (every module imports in
the installed environment: a wheel the GPU machine lacks shows here): `make test` has already
run them on the CPU, up to their CUDA call, where tests/conftest.py fails any skip but the one
at that call. A CPU run that is not the rehearsal runs them as CUDA would, up to that call.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.record import Deadline, Record, run

GPU_PATHS = ("tests/gpu", "tests/core", "tests/planner", "tests/workers")
SUITES = ("tests/core", "tests/planner", "tests/workers")
CUDA_ONLY = "CUDA only:"


def junit(path: Path, slowest: int = 12) -> dict[str, Any]:
    """Counts, failures, skip reasons and the slowest tests (what to leave out of a short
    call) from a pytest JUnit XML file."""
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": [],
                           "slowest": []}
    if not path.exists():
        return out
    times = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        times.append({"test": name, "seconds": round(float(case.get("time") or 0), 2)})
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"] += 1
            out["failures"].append({"test": name, "message": (bad.get("message") or "")[:500]})
        elif skip is not None:
            out["skipped"] += 1
            out["skips"].append({"test": name, "reason": (skip.get("message") or "")[:300]})
        else:
            out["passed"] += 1
    out["slowest"] = sorted(times, key=lambda t: -t["seconds"])[:slowest]
    return out


def pytest(args: list[str], xml: Path, deadline: Deadline, log: Path) -> tuple[int, dict[str, Any]]:
    ran = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
               "console_output_style=classic", f"--junitxml={xml}", *args],
              timeout_s=deadline.left(), log=log)
    counts = junit(xml)
    counts.update(rc=ran.rc, seconds=ran.seconds, tail=ran.tail(1500))
    return ran.rc, counts


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    cuda = cfg.device == "cuda"
    if not deadline.allows(cfg.tests_estimate_s):  # killed half-way, pytest would report nothing
        rec.skip("pytest -m gpu " + " ".join(GPU_PATHS), f"{deadline.left():.0f} s left of the "
                 f"call; they take about {cfg.tests_estimate_s:.0f} s")
        return
    if not cuda and cfg.quick:
        rc, gpu = pytest(["--collect-only", "-q", *GPU_PATHS], work / "tests-gpu.xml", deadline,
                         work / "tests-gpu.log")
        rec.item({"what": "pytest --collect-only " + " ".join(GPU_PATHS), **gpu})
        rec.check("gpu tests and suites import in this environment", rc == 0,
                  gpu["tail"][-600:])
        return
    rc, gpu = pytest(["-m", "gpu", *GPU_PATHS], work / "tests-gpu.xml", deadline,
                     work / "tests-gpu.log")
    rec.item({"what": "pytest -m gpu " + " ".join(GPU_PATHS), **gpu})
    rec.check("gpu tests: none failed", rc in (0, 5) and gpu["failed"] == 0,
              "; ".join(f"{f['test']}: {f['message']}" for f in gpu["failures"]) or gpu["tail"][-300:])
    rec.check("gpu tests: some ran", gpu["passed"] + gpu["skipped"] > 0)
    if cuda:
        rec.check("gpu tests: none skipped on CUDA", gpu["skipped"] == 0,
                  "; ".join(f"{s['test']}: {s['reason']}" for s in gpu["skips"]))
    else:
        stray = [s for s in gpu["skips"] if CUDA_ONLY not in s["reason"]
                 and "needs CUDA" not in s["reason"]]
        rec.check("gpu tests: skipped only at their CUDA call", not stray,
                  "; ".join(f"{s['test']}: {s['reason']}" for s in stray))
    if cfg.full_suites:
        if not deadline.allows(120):
            rec.skip("pytest " + " ".join(SUITES), f"{deadline.left():.0f} s left")
            return
        rc, suites = pytest(["-m", "not gpu", *SUITES], work / "tests-suites.xml", deadline,
                            work / "tests-suites.log")
        rec.item({"what": "pytest -m 'not gpu' " + " ".join(SUITES), **suites})
        rec.check("planner and workers suites pass", rc == 0 and suites["failed"] == 0,
                  "; ".join(f"{f['test']}: {f['message']}" for f in suites["failures"][:10])
                  or suites["tail"][-300:])
    else:  # the run above collected them all (imported every module) before it chose
        rec.check("planner and workers suites import in this environment", rc != 2,
                  gpu["tail"][-600:])  # pytest's 2: collection errors
