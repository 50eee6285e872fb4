"""``python -m bench.gpu``: the steps of the GPU run, in the installed environment.

    python -m bench.gpu --device cuda|cpu [--quick] [--step all|tests,profile,...]
                        [--out out/gpu] [--deadline-s 540] [--dtypes float32,float16]
                        [--no-suites]

`make gpu` runs this after bench/gpu/install.py (bench/gpu/launch.py does both). Each step
writes out/<step>.json (and copies it to $OUT on the device machine); ``summary`` writes
summary.md from every record present. The exit code is 1 when a check of a step that ran
failed, so CI fails on the rehearsal's failures.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from bench.gpu import config, record, summary

STEPS = ("tests", "profile", "graphs", "bench", "serve", "energy")  # serve's time is the better known


def steps_of(text: str) -> list[str]:
    """The steps to run, in the run's order; the summary always comes last (it is cheap, and a
    device call brings back the summary of what it ran)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names in (["all"], []):
        names = list(STEPS)
    unknown = [s for s in names if s not in (*STEPS, "summary")]
    if unknown:
        raise SystemExit(f"--step {text!r}: unknown {', '.join(unknown)}; use all or a comma list "
                         f"of {', '.join((*STEPS, 'summary'))}")
    return [s for s in STEPS if s in names] + ["summary"]


def run_step(name: str, cfg: config.Config, out: Path, deadline: record.Deadline) -> bool:
    """One step, its failures recorded (never raised): True when its checks passed."""
    from importlib import import_module

    rec = record.Record(name, out, cfg.device, cfg.quick)
    try:
        rec.set(environment=record.environment())
        module = import_module(f"bench.gpu.step_{name}")
        module.main(cfg, out / "work", rec, deadline)
    except Exception:  # noqa: BLE001 - a step's crash is its record's failure, not the run's
        rec.check(f"{name} ran to its end", False, traceback.format_exc()[-1500:])
    print(f"[gpu] {name}: {'ok' if rec.data['ok'] else 'FAILED'} in {rec.data['elapsed_s']:.0f} s",
          flush=True)
    return bool(rec.data["ok"])


def run_summary(cfg: config.Config, out: Path) -> bool:
    rec = record.Record("summary", out, cfg.device, cfg.quick)
    path = summary.write(out)
    text = path.read_text()
    first = text.splitlines()[0]
    on_gpu = first.startswith("**GPU run")
    rec.check("first line says where it ran", on_gpu or ("CPU rehearsal" in first
                                                         and "none is a GPU result" in first), first)
    rec.check("names every step", all(f"| {s} |" in text for s in summary.STEPS))
    summary.write(out)  # again, with this record in its table of steps
    record.publish(path)
    print(f"[gpu] summary: {path}", flush=True)
    return bool(rec.data["ok"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--quick", action="store_true", help="small models: the CPU rehearsal")
    parser.add_argument("--step", default="all")
    parser.add_argument("--out", type=Path, default=record.ROOT / "out" / "gpu")
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="seconds the whole call may take (a device call has 600)")
    parser.add_argument("--dtypes", default=",".join(config.DTYPES),
                        help="the full run's dtypes, in order (a short lease: float32)")
    parser.add_argument("--no-suites", action="store_true",
                        help="step tests: only the tests marked gpu, not the whole suites")
    args = parser.parse_args(argv)
    cfg = config.config(args.device, args.quick,
                        tuple(d.strip() for d in args.dtypes.split(",") if d.strip()),
                        suites=not args.no_suites)
    steps = steps_of(args.step)
    if args.device == "cuda" and steps != ["summary"]:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda, but torch sees no CUDA device: run the rehearsal with "
                             "DEVICE=cpu QUICK=1")
    deadline = record.Deadline(args.deadline_s)
    (args.out / "work").mkdir(parents=True, exist_ok=True)
    ok = True
    for name in steps:
        ok = (run_summary(cfg, args.out) if name == "summary"
              else run_step(name, cfg, args.out, deadline)) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
