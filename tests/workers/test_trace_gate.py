"""A model traced while another model serves batches on another thread (one torch thread per
model, a model loading beside one serving): torch.fx patches ``torch.nn.Module.__call__`` for
the whole process while it traces, so without ``MODULE_GATE`` the serving model's module calls
fail ("module is not installed as a submodule") or land in the other model's trace."""

from __future__ import annotations

import threading

import torch

from core.units import MODULE_GATE
from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from workers.memory import MemoryProbe
from workers.worker import Worker


def test_a_trace_beside_a_serving_model_changes_neither() -> None:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))))
    profile = measure(cap, ProfileOptions(batch_max=2, repeats=1, warmup=0), progress=False)
    worker = Worker(cap, build_table(profile, slot_count=32), MemoryProbe("cpu"))
    x = cap.model.example(2)
    with torch.inference_mode():
        expected = cap.model.module(x)
    other = load_model(ModelSpec("resnet18", input_shape=(3, 32, 32)))
    alone = capture(other).tree  # what the trace gives with nothing else running

    stop = threading.Event()
    served = threading.Event()
    errors: list[BaseException] = []
    runs = [0]

    def serve() -> None:
        try:
            with torch.inference_mode():
                while not stop.is_set():
                    y, _ = worker.infer(x, free=lambda: 1 << 30)
                    # a plan may run the batch in pieces: equal to model(x) up to rounding
                    torch.testing.assert_close(y, expected)
                    runs[0] += 1
                    served.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)
            served.set()

    thread = threading.Thread(target=serve, name="serving")
    thread.start()
    try:
        assert served.wait(60)
        trees = [capture(other).tree for _ in range(3)]  # traced while batches run beside it
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
    assert runs[0] > 0
    assert all(tree == alone for tree in trees)


def test_a_plan_of_one_onnxruntime_call_runs_beside_a_trace_and_a_torch_plan_waits() -> None:
    """The gate guards module calls only: a plan that is one ONNX Runtime call of the whole
    model calls none, so it runs while a trace holds the gate; a plan on torch waits for the
    trace to end."""
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))))
    x = cap.model.example(1)
    with torch.inference_mode():
        expected = cap.model.module(x)
    workers = {runtime: Worker(cap, build_table(measure(cap, ProfileOptions(
        batch_max=2, repeats=1, warmup=0, runtime=runtime), progress=False), slot_count=32),
        MemoryProbe("cpu")) for runtime in ("onnxruntime", "torch")}
    for runtime, worker in workers.items():
        choice = worker.choose(worker.table, 1, worker.table.top_bytes)
        assert worker._plan_run(choice).calls_modules == (runtime == "torch"), runtime

    results: dict[str, torch.Tensor] = {}
    finished = {runtime: threading.Event() for runtime in workers}

    def infer(runtime: str) -> None:
        results[runtime], _ = workers[runtime].infer(x, free=lambda: 1 << 30)
        finished[runtime].set()

    threads = [threading.Thread(target=infer, args=(runtime,)) for runtime in workers]
    with MODULE_GATE.tracing():
        for thread in threads:
            thread.start()
        assert finished["onnxruntime"].wait(60)  # not behind the trace
        assert not finished["torch"].is_set()    # behind it
    for thread in threads:
        thread.join(60)
    assert finished["torch"].is_set()
    for y in results.values():
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5)
