"""A table swapped in (``worker.table = ...``, as the registry does from the event loop) while the
worker's thread is choosing plans: a batch never mixes the plans of two tables, each piece's
plan is the one its own table gives, and the outputs stay model(x)."""

from __future__ import annotations

import threading
import time

import torch

from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from workers.memory import MemoryProbe
from tests.service.test_reload import regular
from workers.worker import Worker

ROUNDS = 200


def test_a_swap_during_plan_choice_never_mixes_tables() -> None:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("tests.planner.factories:two_layer", input_shape=(3, 8, 8))))
    # fixed costs and no workspaces: more samples always need more memory (a measured
    # profile on a shared CPU is too noisy to promise that)
    profile = regular(measure(cap, ProfileOptions(batch_max=4, repeats=1, warmup=0),
                              progress=False))
    fine = build_table(profile, slot_count=64)
    coarse = build_table(profile, slot_bytes=fine.slot_bytes * 4)
    tables = (fine, coarse)
    worker = Worker(cap, fine, MemoryProbe("cpu"))
    # room for one sample at a time in either table: every batch of 4 runs as 4 pieces, 4 plan
    # choices, so a table read per piece (not once per batch) would mix the two
    free = min(int(t.min_peaks[1]) for t in tables) - 1
    assert all(t.largest_fitting(4, free) == 1 for t in tables)
    x = cap.model.example(4)
    with torch.inference_mode():
        expected = cap.model.module(x)
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        while not stop.is_set():
            worker.table = tables[swaps[0] % 2]
            swaps[0] += 1
            time.sleep(0)  # yield the GIL: swaps land between the worker's own steps

    thread = threading.Thread(target=swapper, name="swapper")
    thread.start()
    seen = set()
    try:
        for _ in range(ROUNDS):
            y, info = worker.infer(x, free=lambda: free)
            torch.testing.assert_close(y, expected)
            used = {id(c.table) for c in info.choices}
            assert len(used) == 1, "one batch ran plans of two tables"
            table = info.choices[0].table
            seen.add(id(table))
            assert [c.batch for c in info.choices] == [1, 1, 1, 1]
            for c in info.choices:  # each plan is what its own table gives for that piece
                assert c.index == table.find(c.batch, free)
                assert c.plan_id == table.plans[c.index].plan_id
                assert c.program.steps == table.program(c.index).steps
    finally:
        stop.set()
        thread.join(timeout=30)
    assert swaps[0] > ROUNDS  # the swapper ran all along
    assert seen == {id(fine), id(coarse)}, "batches ran under both tables"
