"""`make gpu`: install vbs-serve as the machine allows, then run the steps (``python -m bench.gpu``).

    python3 bench/gpu/launch.py --device cuda|cpu [--quick] [--step all|smoke,bench,serve,...]
                                [--out out/gpu] [--deadline-s 540]
                                [--dtypes float32,float16] [--runtimes cudagraph,torch]
                                [--benches cudagraph:float16,...] [--no-suites] [--tag call2]

Every device call starts on a bare machine, so every call installs (a minute at most) before
its steps: the machine's own Python on CUDA, a fresh venv on the CPU (bench/gpu/install.py).
The install's record is out/install.json (install-TAG.json with ``--tag``), in the steps'
format. ``--step install`` stops there. Standard library only, like the install.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import install  # noqa: E402 - bench/gpu/install.py, beside this file

ROOT = install.ROOT


def _write(out: Path, record: dict, tag: str = "") -> None:
    path = out / (f"install-{tag}.json" if tag else "install.json")
    path.write_text(json.dumps(record, indent=1))
    dest = os.environ.get("OUT")
    if dest and Path(dest).is_dir():
        shutil.copy2(path, Path(dest) / path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--step", default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu")
    parser.add_argument("--deadline-s", type=float, default=540.0)
    parser.add_argument("--dtypes", help="passed on: the full run's dtypes (default both)")
    parser.add_argument("--runtimes", help="passed on: the benches' runtimes (default both)")
    parser.add_argument("--benches", help="passed on: the benches' RUNTIME:DTYPE pairs")
    parser.add_argument("--no-suites", action="store_true", help="passed on: gpu tests only")
    parser.add_argument("--tag", default="", help="passed on: records named <step>-TAG.json")
    parser.add_argument("--wheels", type=Path, help="default .gpu-wheels/cpXY of the target Python")
    args = parser.parse_args(argv)
    if args.step == "summary":  # the records of earlier calls, summarised here: nothing to install
        here = ROOT / ".venv" / "bin" / "python"
        return subprocess.call([str(here) if here.exists() else sys.executable, "-m", "bench.gpu",
                                "--device", args.device, "--step", "summary", "--out",
                                str(args.out), *(["--tag", args.tag] if args.tag else [])],
                               cwd=ROOT)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"step": "install", "device": args.device, "quick": args.quick, "tag": args.tag,
              "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "ok": False, "checks": [], "items": [], "skipped": []}
    try:
        report = install.install(args.device, args.wheels, ROOT / ".venv-gpu",
                                 ROOT / ".venv" / "bin" / "python")
    except install.InstallError as exc:
        record["checks"].append({"name": "install", "ok": False, "detail": str(exc)[-3000:]})
        record["elapsed_s"] = round(time.monotonic() - started, 2)
        _write(args.out, record, args.tag)
        print(f"[gpu] install FAILED: {exc}", file=sys.stderr)
        return 1
    record.update(report)
    record["checks"] = [
        {"name": "every requirement installed", "ok": not report["missing"],
         "detail": ", ".join(report["missing"])},
        {"name": "every module imports", "ok": not report["import_errors"],
         "detail": json.dumps(report["import_errors"])[:1500]},
    ]
    if args.device == "cuda":
        cuda = bool(report["device_info"].get("cuda_available"))
        record["checks"].append({"name": "torch sees CUDA", "ok": cuda,
                                 "detail": json.dumps(report["device_info"])})
    record["ok"] = all(c["ok"] for c in record["checks"])
    record["elapsed_s"] = round(time.monotonic() - started, 2)
    _write(args.out, record, args.tag)
    print(f"[gpu] install: {'ok' if record['ok'] else 'FAILED'} in {record['elapsed_s']:.0f} s "
          f"({report['python']})", flush=True)
    if not record["ok"]:
        print(json.dumps(record["checks"], indent=1), file=sys.stderr)
        return 1
    if args.step == "install":
        return 0
    cmd = [report["python"], "-m", "bench.gpu", "--device", args.device, "--step", args.step,
           "--out", str(args.out),
           "--deadline-s", str(max(60.0, args.deadline_s - (time.monotonic() - started)))]
    if args.quick:
        cmd.append("--quick")
    for flag, value in (("--dtypes", args.dtypes), ("--runtimes", args.runtimes),
                        ("--benches", args.benches), ("--tag", args.tag)):
        if value:
            cmd += [flag, value]
    if args.no_suites:
        cmd.append("--no-suites")
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
