"""``python -m bench.gpu``: the steps of the GPU run, in the installed environment.

    python -m bench.gpu --device cuda|cpu [--quick] [--step all|smoke,bench,serve,...]
                        [--out out/gpu] [--deadline-s 540] [--dtypes float32,float16]
                        [--runtimes cudagraph,torch] [--benches cudagraph:float16,...]
                        [--no-suites] [--tag call2]

`make gpu` runs this after bench/gpu/install.py (bench/gpu/launch.py does both). Each step
writes out/<step>.json (out/<step>-<tag>.json with ``--tag``; copied to $OUT on the device
machine); ``summary`` writes summary.md from every record present. Steps run in the order
given (``all``: STEPS), the smoke test always first: when it fails nothing else runs. The exit
code is 1 when a check of a step that ran failed, so CI fails on the rehearsal's failures.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from bench.gpu import config, record, summary

STEPS = ("smoke", "tests", "profile", "graphs", "bench", "serve", "energy")
GATE = "smoke"  # when it fails, nothing after it runs


def steps_of(text: str) -> list[str]:
    """The steps to run: ``all`` in STEPS' order, else in the order given, each once, the smoke
    test first; the summary always comes last (it is cheap, and a device call brings back the
    summary of what it ran)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names in (["all"], []):
        names = list(STEPS)
    unknown = [s for s in names if s not in (*STEPS, "summary")]
    if unknown:
        raise SystemExit(f"--step {text!r}: unknown {', '.join(unknown)}; use all or a comma list "
                         f"of {', '.join((*STEPS, 'summary'))}")
    ordered = list(dict.fromkeys(s for s in names if s != "summary"))
    if GATE in ordered:
        ordered.remove(GATE)
        ordered.insert(0, GATE)
    return ordered + ["summary"]


def run_step(name: str, cfg: config.Config, out: Path, deadline: record.Deadline,
             tag: str = "") -> record.Record:
    """One step, its failures recorded (never raised); its record (``data['ok']``: its checks
    passed)."""
    from importlib import import_module

    rec = record.Record(name, out, cfg.device, cfg.quick, tag)
    try:
        rec.set(environment=record.environment())
        module = import_module(f"bench.gpu.step_{name}")
        module.main(cfg, out / "work", rec, deadline)
    except Exception:  # noqa: BLE001 - a step's crash is its record's failure, not the run's
        rec.check(f"{name} ran to its end", False, traceback.format_exc()[-1500:])
    print(f"[gpu] {name}: {'ok' if rec.data['ok'] else 'FAILED'} in {rec.data['elapsed_s']:.0f} s",
          flush=True)
    return rec


def run_summary(cfg: config.Config, out: Path, tag: str = "") -> bool:
    rec = record.Record("summary", out, cfg.device, cfg.quick, tag)
    path = summary.write(out, record.tagged("summary.md", tag))
    text = path.read_text()
    first = text.splitlines()[0]
    on_gpu = first.startswith("**GPU run")
    rec.check("first line says where it ran", on_gpu or ("CPU rehearsal" in first
                                                         and "none is a GPU result" in first), first)
    rec.check("names every step", all(f"| {s} |" in text for s in summary.STEPS))
    summary.write(out, path.name)  # again, with this record in its table of steps
    record.publish(path)
    print(f"[gpu] summary: {path}", flush=True)
    return bool(rec.data["ok"])


def _list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--quick", action="store_true", help="small models: the CPU rehearsal")
    parser.add_argument("--step", default="all")
    parser.add_argument("--out", type=Path, default=record.ROOT / "out" / "gpu")
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="seconds the whole call may take (a device call has 600)")
    parser.add_argument("--dtypes", default=",".join(config.DTYPES),
                        help="the full run's dtypes, in order (a short lease: float32)")
    parser.add_argument("--runtimes", default=f"{config.GRAPHS},{config.RUNTIME}",
                        help="the benches' runtimes, in order (graphs only: cudagraph)")
    parser.add_argument("--benches", help="the benches' RUNTIME:DTYPE pairs, in order "
                        "(instead of --runtimes x --dtypes), e.g. cudagraph:float16,torch:float32")
    parser.add_argument("--no-suites", action="store_true",
                        help="step tests: only the tests marked gpu, not the whole suites")
    parser.add_argument("--tag", default="", help="records named <step>-TAG.json (a second "
                        "call's, beside the first's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    cfg = config.config(args.device, args.quick, _list(args.dtypes), suites=not args.no_suites,
                        runtimes=_list(args.runtimes), benches=args.benches)
    steps = steps_of(args.step)
    if args.device == "cuda" and steps != ["summary"]:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda, but torch sees no CUDA device: run the rehearsal with "
                             "DEVICE=cpu QUICK=1")
    deadline = record.Deadline(args.deadline_s)
    (args.out / "work").mkdir(parents=True, exist_ok=True)
    ok = True
    for i, name in enumerate(steps):
        if name == "summary":
            ok = run_summary(cfg, args.out, args.tag) and ok
            continue
        rec = run_step(name, cfg, args.out, deadline, args.tag)
        ok = bool(rec.data["ok"]) and ok
        if name == GATE and not rec.data["ok"]:
            for later in steps[i + 1:-1]:
                rec.skip(later, "the smoke test failed: nothing after it runs")
            print(f"[gpu] the smoke test failed: {', '.join(steps[i + 1:-1]) or 'nothing'} not "
                  "run", flush=True)
            ok = run_summary(cfg, args.out, args.tag) and False
            break
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
