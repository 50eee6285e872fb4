"""ONNX Runtime's threads in vbs-serve: they spin while a call runs and are asleep once it
returns, in serving and in profiling alike, and outputs do not change.

Whether the threads spin is read from the threads themselves: the CPU time the kernel
accounts to each thread a session started (``/proc/self/task/<tid>/stat``), over a window
after the last call. A thread asleep accrues none; the control, a session left to spin
after its calls, shows the reading sees spinning when there is some. How fast anything
runs is a benchmark's question (bench/kernels.py, bench/idle.py), never asserted here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch

from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from core.tree import iter_layers
from workers.executor import _one_call
from workers.memory import MemoryProbe
from workers.worker import Worker

ort = pytest.importorskip("onnxruntime")
from core.runtimes.onnxrt import SPIN, STOP, OrtUnits, session_options  # noqa: E402

SHAPE = (3, 64, 64)
WINDOW_S = 1.0


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _ticks(tids: set[str]) -> int:
    """CPU clock ticks (user + system) the kernel accounted to the threads ``tids``."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total


def _after(call: Callable[[], object], threads: set[str]) -> int:
    """Ticks the ``threads`` accrue in the window that follows a few ``call``s."""
    for _ in range(5):
        call()
    before = _ticks(threads)
    time.sleep(WINDOW_S)
    return _ticks(threads) - before


def _model():
    torch.manual_seed(0)
    return capture(load_model(ModelSpec("mobilenet_v2", input_shape=SHAPE)))


def test_a_sessions_threads_are_asleep_once_its_call_returns_and_spin_without_the_policy() -> None:
    cap = _model()
    layers = list(iter_layers(cap.tree))
    x = cap.model.example(1, seed=0)
    onnx = OrtUnits(cap, threads=2).graphs.compose(layers[:1]).SerializeToString()

    def started(options: ort.SessionOptions) -> tuple[ort.InferenceSession, set[str]]:
        before = _tasks()
        session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
        threads = _tasks() - before
        assert threads, "the session started no intra-op thread to watch"
        return session, threads

    served, served_threads = started(session_options(2))
    feed = {"x": x.numpy()}
    assert _after(lambda: served.run(None, feed), served_threads) <= 1  # a tick: a wake-up's tail
    # the control: the same session without the stop, told to spin on for a while after a call
    spinning = session_options(2)
    spinning.add_session_config_entry(STOP, "0")
    spinning.add_session_config_entry("session.intra_op.spin_duration_us", str(int(1e6 * WINDOW_S)))
    control, control_threads = started(spinning)
    assert _after(lambda: control.run(None, feed), control_threads) >= 5  # a busy machine lends it less


def test_a_served_models_sessions_use_the_policy_and_go_to_sleep_idle() -> None:
    cap = _model()
    profile = measure(cap, ProfileOptions(batch_max=4, repeats=1, warmup=0, runtime="onnxruntime"),
                      progress=False)
    before = _tasks()
    worker = Worker(cap, build_table(profile, slot_count=64), MemoryProbe("cpu"))
    threads = _tasks() - before  # the pools of the sessions its plans use
    assert worker.runtimes["onnxruntime"].sessions >= 1 and threads
    for run in worker.runtimes["onnxruntime"]._runs.values():
        options = run.session.get_session_options()
        assert options.get_session_config_entry(SPIN) == "1"
        assert options.get_session_config_entry(STOP) == "1"
    x = cap.model.example(4, seed=1)
    with torch.inference_mode():
        expected = cap.model.module(x)
    outputs = []
    idle = _after(lambda: outputs.append(worker.infer(x)[0]), threads)
    assert idle <= 1
    for y in outputs:
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    # one sample: the whole model in one call, made without the walk, equals the model too
    one = worker.choose(worker.table, 1, worker.table.top_bytes)
    assert _one_call(cap, one.program.steps, one.runs, 1), one.plan_id
    y, _ = worker.infer(x[:1])
    torch.testing.assert_close(y, expected[:1], rtol=1e-4,
                               atol=1e-4 * float(expected.abs().max()))


def test_the_profiler_measures_with_the_threads_serving_runs() -> None:
    from planner.profiling.ort import prepare

    cap = _model()
    prepared = prepare(cap, [cap.model.example(1, seed=0)])
    assert not isinstance(prepared, str) and prepared.runs
    assert prepared.units.spin
    profiled = prepared.profiled_sessions()
    try:
        for p in profiled:
            options = p.session.get_session_options()
            assert options.get_session_config_entry(SPIN) == "1"
            assert options.get_session_config_entry(STOP) == "1"
            assert options.intra_op_num_threads == prepared.units.threads == torch.get_num_threads()
    finally:
        from planner.profiling.ort import kernel_times

        kernel_times(profiled)  # ends their profiling, removes their files
