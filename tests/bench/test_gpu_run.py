"""The GPU run's plumbing, on the CPU: which steps and benches a call runs and in what order,
the hog's steps, the snapshots' trim, two calls' records summarised as one with issue 55's
done-when, and the smoke step skipping at its CUDA call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import config, done, summary
from bench.gpu.__main__ import steps_of
from bench.gpu.snapshots import trim
from workers.device_cache import cache_of

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def test_steps_run_in_the_order_given_the_smoke_test_first() -> None:
    assert steps_of("bench,serve,smoke") == ["smoke", "bench", "serve", "summary"]
    assert steps_of("serve,bench,tests") == ["serve", "bench", "tests", "summary"]
    assert steps_of("all")[0] == "smoke" and steps_of("all")[-1] == "summary"
    with pytest.raises(SystemExit, match="unknown"):
        steps_of("smoke,benches")


def test_a_call_selects_graph_benches_of_one_dtype_or_any_pairs() -> None:
    first = config.config("cuda", False, ("float32",), suites=False, runtimes=("cudagraph",))
    assert [(b.model, b.dtype, b.runtime, b.batch) for b in first.benches] == \
        [(m, "float32", "cudagraph", 12) for m in config.MODELS]
    rest = config.config("cuda", False, benches="cudagraph:float16,torch:float32")
    assert [(b.runtime, b.dtype) for b in rest.benches[::5]] == [("cudagraph", "float16"),
                                                                ("torch", "float32")]
    with pytest.raises(SystemExit, match="RUNTIME:DTYPE"):
        config.bench_pairs("onnxruntime:float32")
    assert first.serve.run.estimate_s == first.serve.needed_s > 0


def test_the_hog_takes_then_gives_back_step_by_step(tmp_path: Path) -> None:
    ready, out = tmp_path / "held", tmp_path / "hog.json"
    subprocess.run([sys.executable, str(ROOT / "bench/memory_hog.py"), "--device", "cpu",
                    "--take-steps", "24MiB,16MiB,8MiB", "--memory-limit", "32MiB",
                    "--hold-s", "0.05", "--ready", str(ready), "--out", str(out)],
                   check=True, timeout=60)
    report = json.loads(out.read_text())
    assert ready.exists() and report["schedule"] == "steps"
    assert [c["taken"] for c in report["log"]] == [24 * MiB, 16 * MiB, 8 * MiB, 0]
    times = [c["t"] for c in report["log"]]
    assert times == sorted(times)


def test_a_trimmed_snapshot_reads_as_the_whole_one() -> None:
    frames = [{"filename": "x.py", "line": 1, "name": "f"}] * 3
    segments = [
        {"device": 0, "address": 0, "total_size": 40 * MiB, "allocated_size": 12 * MiB,
         "active_size": 12 * MiB, "requested_size": 12 * MiB, "stream": 0,
         "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": True,
         "frames": frames, "blocks": [
             {"address": 0, "size": 12 * MiB, "requested_size": 12 * MiB,
              "state": "active_allocated", "frames": frames},
             {"address": 12 * MiB, "size": 28 * MiB, "requested_size": 0, "state": "inactive",
              "frames": frames}]},
        {"device": 0, "address": 1 << 40, "total_size": 2 * MiB, "allocated_size": 0,
         "stream": 0, "segment_type": "small", "segment_pool_id": (1, 2),
         "is_expandable": False, "blocks": [{"address": 1 << 40, "size": 2 * MiB,
                                              "state": "inactive"}]},
    ]
    kept = trim(segments)
    assert cache_of(kept) == cache_of(segments)
    assert "frames" not in json.dumps(kept)
    assert json.loads(json.dumps(kept)) == kept  # plain JSON


def _bench_item(model: str, low: float, high: float) -> dict:
    rows = [{"strategy": "vbs", "memory_budget": b, "feasible": True, "calls": 3,
             "time_per_sample_measured": 1e-3, "gain_over_fbs_best": g}
            for b, g in ((10 * MiB, low), (20 * MiB, high))]
    return {"label": model, "model": model, "dtype": "float32", "runtime": "cudagraph",
            "batch": 12, "rows": rows, "gains": {}, "runtimes": ["cudagraph"],
            "plans": {"feasible": 2, "ran": 2, "with_calls": 2, "calls": 6},
            "summary": {"runs": 2, "budget_exceeded": 0, "time_mape": 9.0,
                        "claimed_equals_measured": 2, "peak_mape": 0.0}}


def _record(step: str, tag: str, items: list, **fields: object) -> dict:
    return {"step": step, "device": "cuda", "quick": False, "tag": tag, "ok": True,
            "started_at": "t", "elapsed_s": 1.0, "checks": [], "skipped": [], "items": items,
            "environment": {"gpu": "H200"}, **fields}


def test_two_calls_records_are_summarised_as_one_against_the_done_when(tmp_path: Path) -> None:
    models = config.MODELS
    (tmp_path / "bench.json").write_text(json.dumps(_record("bench", "", [
        _bench_item(m, 1.0, 1.5) for m in models[:3]])))
    (tmp_path / "bench-call2.json").write_text(json.dumps(_record("bench", "call2", [
        _bench_item(m, 0.97, 1.1) for m in models[3:]])))
    (tmp_path / "bench-before.json").write_text("{}")  # not a call's record: left out
    served = [{"solver": s, "ready": True, "load": {"ok": 100, "errors": 0,
                                                    "throughput_samples_per_s": rate},
               "metrics": {"rejected": 0, "requests_5xx": 0}} for s, rate in
              (("vbs", 300.0), ("fbs-best", 200.0))]
    served[0]["moving"] = {"load": {"ok": 50, "errors": 0}, "settled_peaks": [20, 60, 100, 140],
                           "distinct_settled": 4}
    served.append({"what": "offline", "vbs_samples_per_s": 350.0})
    (tmp_path / "serve-call2.json").write_text(json.dumps(_record("serve", "call2", served)))
    records = summary._load(tmp_path)
    assert len(records["bench"]["items"]) == len(models)
    met = {name: ok for name, _, ok in done.criteria(records, summary.served_ratios(
        records["serve"]))}
    assert all(met.values()), met
    text = summary.write(tmp_path).read_text()
    assert "## Issue 55: done when" in text and "**no**" not in text
    # one model below 0.95x somewhere: not met
    (tmp_path / "bench-call2.json").write_text(json.dumps(_record("bench", "call2", [
        _bench_item(m, 0.9, 1.1) for m in models[3:]])))
    rows = done.criteria(summary._load(tmp_path), {})
    assert [ok for name, _, ok in rows if "never" in name] == [False]
    assert [ok for name, _, ok in rows if "offline" in name] == [None]  # not measured


def test_the_smoke_step_skips_at_its_cuda_call_and_the_run_goes_on(tmp_path: Path) -> None:
    done_ = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick",
                            "--step", "smoke", "--out", str(tmp_path), "--tag", "t"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done_.returncode == 0, done_.stdout + done_.stderr
    record = json.loads((tmp_path / "smoke-t.json").read_text())
    assert record["ok"] and record["skipped"][0]["why"].startswith("CUDA only:")
    assert (tmp_path / "summary-t.md").exists()
