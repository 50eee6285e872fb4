"""Plans on ONNX Runtime, on real models: outputs equal ``model(x)``, the executor allocates what
the walk counts, and what ONNX Runtime holds inside its calls stays within the table's claim.

Named models of every structure the planner meets (add, concatenation and multiplication
joins, opaque dense blocks, channel shuffles, 3-D convolutions, layer norms) and small ones it
has never seen, each profiled with ``--runtime onnxruntime`` (every unit it takes on it, so
there are steps to check whichever runtime this machine measures faster) and some with
``auto`` (the faster per step), planned, and run by a Worker at several memory limits and
request sizes. Which runtime is faster is a benchmark's question, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.measure import cpu_peaks
from planner.profiling.profiler import ProfileOptions, fingerprint, measure
from core.runtimes.base import RuntimeOptions
from core.runtimes.ort_sessions import SESSION_GROWTH
from core.runtimes.ort_memory import ENV
from core.walk import executor_peak
from planner.solver.tables import build_table
from core.tree import Parallel, Profile, iter_layers, iter_nodes
from workers.executor import execute
from workers.memory import MemoryProbe
from workers.worker import Worker

ORT = "onnxruntime"
REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "mobilenet_v2": (3, 64, 64), "googlenet": (3, 64, 64), "efficientnet_b0": (3, 64, 64),
    "densenet121": (3, 32, 32), "shufflenet_v2_x1_0": (3, 64, 64), "convnext_tiny": (3, 64, 64),
    "r3d_18": (3, 4, 32, 32), "tests.planner.factories:unexportable": (3, 16, 16),
    "tests.planner.factories:inplace_residual": (3, 16, 16),
}
B = 4


def _worker(name: str, runtime: str = ORT) -> tuple[Worker, Profile]:
    """A worker on ``name``'s table. ``--runtime onnxruntime`` (the default here) puts every
    unit ONNX Runtime takes on it whatever it measured, so the plans have ONNX Runtime steps on
    any machine; ``auto`` lets the measured times choose."""
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec(name, input_shape=SHAPES[name])))
    profile = measure(cap, ProfileOptions(batch_max=B, repeats=1, warmup=0, runtime=runtime),
                      progress=False)
    return Worker(cap, build_table(profile, slot_count=64), MemoryProbe("cpu")), profile


@pytest.mark.parametrize("name, runtime", [(name, ORT) for name in SHAPES] +
                         [("mobilenet_v2", "auto"), ("googlenet", "auto")])
def test_onnxruntime_plans_equal_the_model_and_allocate_what_the_walk_counts(name: str,
                                                                            runtime: str) -> None:
    worker, profile = _worker(name, runtime)
    cap, table = worker.capture, worker.table
    assert table.runtimes == ("torch", ORT)
    if runtime == ORT:
        assert worker.runtimes[ORT].sessions >= 1  # the top plans' sessions
    smallest = int(table.min_peaks[0])
    on_ort = 0
    for fraction in (1.0, 0.4):
        limit = max(smallest, int(table.top_bytes * fraction))
        for r in (1, B):
            x = cap.model.example(r, seed=r)
            with torch.inference_mode():
                expected = cap.model.module(x)
            y, info = worker.infer(x, free=lambda: limit)
            scale = float(expected.abs().max()) or 1.0
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * scale)
            for choice in info.choices:
                assert choice.peak_bytes <= limit
                steps, xr = choice.program.steps, x[:choice.batch]
                measured = cpu_peaks([("run", lambda a: execute(cap, steps, a, choice.splits,
                                                                choice.runs, worker.runtimes),
                                       lambda: xr)])["run"]
                # what torch sees is the walk's count without ONNX Runtime's inside, exactly
                assert measured == executor_peak(profile.root, steps, choice.batch,
                                                 splits=choice.splits, runs=choice.runs,
                                                 inside=False), name
                on_ort += sum(s.runtime == ORT for s in steps)
    assert on_ort > 0 or runtime != ORT, f"{name}: no step ran on ONNX Runtime"
    # every plan of the largest request, not only those picked above: which ones the limits
    # pick depends on the times measured, and a layout the model does not give (a dense ONNX
    # Runtime output where torch's next unit had channels-last) shows only in some of them
    x = cap.model.example(B, seed=B)
    for _, plan in table.plans_for(B):
        steps = plan.program.steps
        measured = cpu_peaks([("run", lambda a: execute(cap, steps, a, plan.split_map,
                                                        plan.run_map, worker.runtimes),
                               lambda: x)])["run"]
        assert measured == executor_peak(profile.root, steps, B, splits=plan.split_map,
                                         runs=plan.run_map, inside=False), (name, plan.plan_id)


@pytest.mark.parametrize("spin", [False, True])
def test_ort_spin_reaches_every_session_and_changes_no_output(spin: bool) -> None:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("mobilenet_v2", input_shape=SHAPES["mobilenet_v2"])))
    profile = measure(cap, ProfileOptions(batch_max=B, repeats=1, warmup=0, runtime=ORT),
                      progress=False)
    worker = Worker(cap, build_table(profile, slot_count=64), MemoryProbe("cpu"),
                    runtime_options=RuntimeOptions(spin=spin))
    x = cap.model.example(B, seed=1)
    with torch.inference_mode():
        expected = cap.model.module(x)
    y, _ = worker.infer(x)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert worker.runtimes[ORT].sessions >= 1
    for run in worker.runtimes[ORT]._runs.values():
        options = run.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == str(int(spin))


def test_sessions_beyond_the_bound_are_given_back_least_recently_used_first() -> None:
    from core.runner import run_unit
    from core.runtimes.onnxrt import OrtUnits

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("mobilenet_v2", input_shape=SHAPES["mobilenet_v2"])))
    units = OrtUnits(cap, max_sessions=2)
    layers = list(iter_layers(cap.tree))[:3]
    inputs, x = [], cap.model.example(2, seed=0)
    with torch.inference_mode():
        for layer in layers:  # each unit's real input, and torch's output for it
            inputs.append((x, run_unit(cap, layer, x)))
            x = inputs[-1][1]

        def run(i: int) -> torch.Tensor:
            layer, (x, _) = layers[i], inputs[i]
            return units.run(layer.name, layer.name, x.contiguous(), units.output(layer, x, 2))

        for i in (0, 1, 0, 2):  # the second is the least recently used when the third comes
            run(i)
        names = [layer.name for layer in layers]
        assert units.sessions == 2
        assert set(units._runs) == {(names[0], names[0]), (names[2], names[2])}
        got = run(1)  # given back, built again: the first is now the least recently used
        assert set(units._runs) == {(names[1], names[1]), (names[2], names[2])}
    torch.testing.assert_close(got, inputs[1][1], rtol=1e-4, atol=1e-4)


def test_a_run_reads_what_its_buffers_hold_now_at_the_same_address_or_another() -> None:
    """A run's input and output are bound by address and bound again only when it changes:
    new values written into the same buffer are what the next call reads, and a call on other
    buffers, or back on the first, reads those."""
    from core.runner import run_unit
    from core.runtimes.onnxrt import OrtUnits

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("mobilenet_v2", input_shape=SHAPES["mobilenet_v2"])))
    units = OrtUnits(cap)
    layer = next(iter_layers(cap.tree))
    buffer, other = cap.model.example(2, seed=0), cap.model.example(2, seed=1)
    out = units.output(layer, buffer, 2)
    with torch.inference_mode():
        for seed, x in enumerate((buffer, buffer, other, buffer), start=2):
            values = cap.model.example(2, seed=seed)  # never what the other buffer holds
            x.copy_(values)
            expected = run_unit(cap, layer, values)
            y = units.run(layer.name, layer.name, x, out)
            assert y.data_ptr() == out.data_ptr()
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
            elsewhere = units.run(layer.name, layer.name, x, units.output(layer, x, 2))
            torch.testing.assert_close(elsewhere, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # not written to


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["RssAnon"].split()[0]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_a_session_is_made_only_where_memory_allows_and_old_ones_go_first() -> None:
    """Before a session is made, ``room`` must cover its SESSION_GROWTH x weights: the least
    recently used sessions are given back until it does, else OutOfMemoryError (the worker's
    smaller plan, a 503), never a session beyond the memory free."""
    from core.errors import OutOfMemoryError
    from core.runtimes.onnxrt import SESSION_GROWTH, OrtUnits, _weight_bytes

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("resnet18", input_shape=(3, 32, 32))))
    children = cap.tree.children
    whole = tuple(children)
    need = SESSION_GROWTH * _weight_bytes(
        OrtUnits(cap).graphs.compose(children))  # resnet18: ~47 MB of weights
    free = [10 * need]
    units = OrtUnits(cap, room=lambda: free[0])
    before = _rss_anon()
    units.prepare(whole, 1)
    grown = _rss_anon() - before
    assert grown <= need, f"a session of {need // SESSION_GROWTH} weight bytes grew {grown}"
    # what it keeps is measured as it is made (resident memory: the weights at least, held once
    # as ONNX Runtime's optimiser left them, which folds a few KB of tiny constants away)
    assert 0.99 * (need // SESSION_GROWTH) <= units.held_bytes <= need
    assert units.cached_bytes == 0
    units.prepare(tuple(children[:3]), 1)
    assert units.sessions == 2
    held = units.held_bytes
    free[0] = 0  # short, and giving every session back would not make it enough: none goes
    with pytest.raises(OutOfMemoryError, match="needs about"):
        units.prepare(tuple(children[3:]), 1)
    assert units.sessions == 2 and units.held_bytes == held  # a smaller plan runs on them
    assert units.making_bytes == need  # what making the largest asked free, asked again
    units.release()
    assert units.sessions == 0
    # where giving sessions back makes it enough, the least recently used go first
    total = [need]
    freed = OrtUnits(cap, room=lambda: total[0] - freed.held_bytes)
    freed.prepare(whole, 1)
    first = tuple(children[:3])
    small = SESSION_GROWTH * _weight_bytes(freed.graphs.compose(first))
    total[0] = freed.held_bytes + small - 1  # short by a byte, unless whole's session goes
    freed.prepare(first, 1)
    assert freed.sessions == 1 and freed.held_bytes < small


_HELD_VS_GROWN = """
import ctypes, gc, json, torch
from core.loaded import ModelSpec
from core.runtimes.onnxrt import OrtUnits
from core.runtimes.ort_memory import status_bytes
from planner.graph.capture import capture
from planner.models import load_model

def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_bytes("VmRSS")

torch.manual_seed(0)
cap = capture(load_model(ModelSpec("mobilenet_v2", input_shape=(3, 32, 32))))
units = OrtUnits(cap)
children = tuple(cap.tree.children)
spans = (children, children[5:], children[:5])
for nodes in spans:  # made once and given back: their graphs cached, the heap as a worker's
    units.prepare(nodes, 1)
units.release()
before = rss()
for nodes in spans:
    units.prepare(nodes, 1)
print(json.dumps({"held": units.held_bytes, "grown": rss() - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_what_sessions_say_they_hold_is_what_the_process_grew_by() -> None:
    """Making a session allocates and frees (a weight read from its file, then packed): what
    its sessions say they hold (``held_bytes``, what the service counts a model's load as) is
    what the process grew by once glibc's free pages are back with the kernel, not those
    pages (which counted 17 MiB too many for mobilenet_v2's three sessions), nor less where
    pages freed before served the session (docs/benchmarks.md, section 13). Three sessions
    of mobilenet_v2 (two of them pack the classifier's weights), made again in a process
    whose heap holds what making them the first time freed."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _HELD_VS_GROWN], capture_output=True,
                          text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    held, grown = seen["held"], seen["grown"]
    assert abs(held - grown) <= 2 * 2**20 + 0.1 * grown, seen


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_a_session_asks_free_the_factor_it_is_given_and_measures_what_making_it_took() -> None:
    """Given the factor `vbs plan` measured for the model (``RuntimeOptions.making_factor``),
    a session asks that times its weights free, to the byte, not the bound; and what making
    it grew the process's peak by, per weight byte, is measured (``making_seen``)."""
    import math

    from core.errors import OutOfMemoryError
    from core.runtimes.onnxrt import OrtUnits, _weight_bytes

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("resnet18", input_shape=(3, 32, 32))))
    whole = tuple(cap.tree.children)
    weights = _weight_bytes(OrtUnits(cap).graphs.compose(whole))
    need = math.ceil(2.5 * weights)
    short = OrtUnits(cap, room=lambda: need - 1, making_factor=2.5)
    with pytest.raises(OutOfMemoryError, match=f"needs about {need} bytes"):
        short.prepare(whole, 1)
    assert short.sessions == 0 and short.making_seen == 0.0
    units = OrtUnits(cap, room=lambda: need, making_factor=2.5)
    units.prepare(whole, 1)
    assert units.making_bytes == need
    # measured, within the bound; in this busy process the making may reuse pages freed
    # before and grow the peak by nothing (0.0 seen in one CI run): that it is measured above
    # 0 is pinned where `vbs plan` measures it, in a fresh process
    # (tests/workers/test_load_cost.py)
    assert 0 <= units.making_seen <= SESSION_GROWTH
    units.release()


def test_a_unit_onnx_cannot_take_runs_on_torch_and_the_profile_says_why() -> None:
    worker, profile = _worker("tests.planner.factories:unexportable")
    units = {layer.name: layer for layer in iter_layers(profile.root)}
    odd = next(layer for name, layer in units.items() if "odd" in name)
    assert "ONNX export failed" in dict(odd.unsupported)[ORT]
    assert odd.runtime == ("torch",) * B and odd.measured(ORT) is None
    others = [layer for layer in units.values() if layer is not odd]
    assert others and all(layer.measured(ORT) is not None for layer in others)
    # the block holding it cannot run whole on ONNX Runtime: its branch can't
    block = next(n for n in iter_nodes(profile.root) if isinstance(n, Parallel)
                 and odd in iter_layers(n))
    assert not any(rt == ORT for rt, _ in block.runtimes)
    plan = worker.table.lookup(B, worker.table.top_bytes)
    assert {s.runtime for s in plan.program.steps if s.unit == odd.name} == {"torch"}
    assert any(s.runtime == ORT for s in plan.program.steps)


def test_runtimes_and_their_versions_are_part_of_the_fingerprint() -> None:
    import onnxruntime

    cap = capture(load_model(ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))))
    prints = {rt: fingerprint(cap, ProfileOptions(batch_max=2, repeats=1, warmup=0, runtime=rt))
              for rt in ("auto", "torch", "onnxruntime")}
    assert len(set(prints.values())) == 3
    profile = measure(cap, ProfileOptions(batch_max=2, repeats=1, warmup=0, runtime="auto"),
                      progress=False)
    assert profile.meta["runtimes"][ORT]["version"] == onnxruntime.__version__
    assert profile.fingerprint == prints["auto"]


@pytest.mark.parametrize("name, shape", [("mobilenet_v2", "3,96,96"),
                                         ("tests.planner.factories:unexportable", "3,32,32")])
def test_what_onnxruntime_holds_inside_its_calls_stays_within_the_claim(name: str,
                                                                         shape: str) -> None:
    """The resident memory a plan really takes, in a child process where every allocation of
    a page or more is a mapping of its own (``rss_child``): never above the table's claim.
    Runs the profiler measured whole are claimed as measured (close to the peak); other runs
    by a bound built from their units, which errs high."""
    env = {**os.environ, **ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "tests.core.rss_child", name, shape, str(B)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows and any(row["onnxruntime"] for row in rows)
    for row in rows:
        assert row["claim"] <= row["limit"]
        assert row["peak"] <= row["claim"], row  # to the page: no slack
