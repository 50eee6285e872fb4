"""The memory arbiter: leases never add up past the budget (checked at every grant), a batch
that cannot get its lease steps down or waits in line (FIFO, so nothing starves), shares follow
demand and an idle model's memory goes to the busy ones, and the knapsack is optimal.

Tables are real ones built by the planner (synthetic network-shaped profiles for the
deterministic cases, measured profiles of real torch models for the concurrent one); the
budget is a real ``MemoryProbe`` with a configured limit (this machine has far more free), as
``VBS_MEMORY_LIMIT_BYTES`` gives it. Threads are gated with events, never with sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from core.errors import ExecutionError, InfeasibleError, LeaseTimeoutError, UsageError
from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.synthetic import googlenet_like, resnet50_like
from core.table import PlanTable
from planner.solver.tables import build_table
from workers.arbiter import Arbiter
from workers.memory import MemoryProbe
from workers.shares import Want, demand_level, divide, time_per_sample, working_bytes
from workers.worker import Worker

MB = 1_000_000


@pytest.fixture(scope="module")
def tables() -> dict[str, PlanTable]:
    return {"big": build_table(resnet50_like(batch_max=8), slot_count=64),
            "small": build_table(googlenet_like(batch_max=8), slot_count=64)}


@dataclass(frozen=True)
class Pick:
    """What a worker picks: a table entry of r samples (or fewer) within some bytes."""

    batch: int
    peak_bytes: int


def picker(table: PlanTable, r: int) -> Callable[[int], Pick | None]:
    def pick(avail: int) -> Pick | None:
        fit = table.largest_fitting(r, avail)
        return Pick(fit, table.plans[table.find(fit, avail)].peak_bytes) if fit else None
    return pick


class Recorder:
    """A listener that checks the arbiter's invariant at every event and keeps the events."""

    def __init__(self) -> None:
        self.arbiter: Arbiter | None = None
        self.events: list[tuple[str, str, int]] = []
        self.waiting = threading.Event()
        self.lock = threading.Lock()

    def on_register(self, device: str, model: str) -> None:
        self.events.append(("register", model, 0))

    def on_budget(self, device: str, budget: int) -> None:
        self.events.append(("budget", device, budget))

    def on_shares(self, shares: dict[str, int]) -> None:
        self.events.append(("shares", ",".join(f"{k}={v}" for k, v in shares.items()), 0))

    def on_lease(self, model: str, leased: int) -> None:
        assert self.arbiter is not None
        assert self.arbiter.leased <= self.arbiter.last_budget or self.arbiter.mode == "none"
        self.events.append(("lease", model, leased))

    def on_wait(self, model: str) -> None:
        self.events.append(("wait", model, 0))
        self.waiting.set()

    def on_step_down(self, model: str) -> None:
        self.events.append(("step_down", model, 0))

    def on_overcommit(self, device: str) -> None:
        self.events.append(("overcommit", device, 0))

    def grants(self, model: str) -> list[int]:
        return [n for kind, m, n in self.events if kind == "lease" and m == model and n > 0]


def make(tables: dict[str, PlanTable], limit: int, demand: dict[str, int], *,
         mode: str = "arbiter", **kwargs: object) -> tuple[Arbiter, Recorder]:
    recorder = Recorder()
    arbiter = Arbiter("cpu", MemoryProbe("cpu", limit=limit).free, mode=mode, listener=recorder,
                      **kwargs)  # type: ignore[arg-type]
    recorder.arbiter = arbiter
    for name in ("a", "b", "c"):
        table = tables["big"] if name == "a" else tables["small"]
        arbiter.register(name, lambda t=table: t, lambda n=name: demand[n])
    return arbiter, recorder


def need(table: PlanTable) -> int:
    return int(table.min_peaks[0])


# --------------------------------------------------------------------------- the knapsack


def test_demand_levels_are_powers_of_two() -> None:
    assert [demand_level(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 4, 4, 8, 8, 16]


def test_the_knapsack_finds_the_least_total_time(tables: dict[str, PlanTable]) -> None:
    """Against every pair of levels: the DP's shares cost no more than the best pair."""
    levels = 32
    for budget in (30 * MB, 60 * MB, 90 * MB):
        wants = [Want("a", tables["big"], 8, 1.0), Want("b", tables["small"], 4, 2.0)]
        shares = divide(budget, wants, levels)
        assert sum(shares.values()) == budget
        grid = (np.arange(levels + 1) * (budget / levels)).astype(np.int64)
        cost = [w.weight * w.samples * time_per_sample(w.table, w.samples, grid) for w in wants]
        best = min(cost[0][i] + cost[1][j] for i in range(levels + 1)
                   for j in range(levels + 1 - i))
        got = sum(w.weight * w.samples * time_per_sample(w.table, w.samples,
                                                         np.array([shares[w.name]]))[0]
                  for w in wants)
        assert got <= best * (1 + 1e-12)


def test_working_bytes_are_the_fewest_within_a_tenth_of_the_fastest(
        tables: dict[str, PlanTable]) -> None:
    """Against every byte count where a plan starts: the first at which a full request runs
    within 10% of its fastest time per sample, and none before it does."""
    for table in tables.values():
        got = working_bytes(table)
        peaks = sorted({int(p) for row in table.rows for p in row.peaks})
        tps = {m: float(time_per_sample(table, table.batch_max, np.array([m]))[0])
               for m in peaks}
        fastest = min(tps.values())
        assert got in tps and tps[got] <= fastest * 1.10
        assert all(tps[m] > fastest * 1.10 for m in peaks if m < got)
        assert int(table.min_peaks[0]) <= got <= table.top_bytes


def test_shares_follow_demand_and_an_idle_model_keeps_only_its_minimum(
        tables: dict[str, PlanTable]) -> None:
    budget = 60 * MB
    big, small = tables["big"], tables["small"]
    alone = divide(budget, [Want("a", big, 8), Want("b", small, 0), Want("c", small, 0, 1.0, 2 * MB)])
    assert alone["b"] == 0 and 2 * MB <= alone["c"] < 2 * MB + budget / 256
    assert alone["a"] == budget - alone["c"]  # the idle models' memory goes to the busy one
    both = divide(budget, [Want("a", big, 8), Want("b", small, 8), Want("c", small, 0)])
    assert both["c"] == 0 and both["b"] >= need(small) and both["a"] >= need(big)
    assert both["a"] < alone["a"]
    # More demand (or weight) on b never shrinks its share.
    more = divide(budget, [Want("a", big, 8), Want("b", small, 8, 4.0), Want("c", small, 0)])
    assert more["b"] >= both["b"]


def test_a_busy_model_gets_a_plan_before_another_gets_faster(tables: dict[str, PlanTable]) -> None:
    big, small = tables["big"], tables["small"]
    budget = int((need(big) + 2 * need(small)) * 1.01)  # about the three smallest plans
    shares = divide(budget, [Want("a", big, 8), Want("b", small, 8), Want("c", small, 8)], 1024)
    assert shares["a"] >= need(big) and shares["b"] >= need(small) and shares["c"] >= need(small)


# --------------------------------------------------------------------------- leases


def test_a_lease_within_the_share_and_returned(tables: dict[str, PlanTable]) -> None:
    demand = {"a": 8, "b": 8, "c": 0}
    arbiter, rec = make(tables, 60 * MB, demand)
    lease = arbiter.acquire("a", picker(tables["big"], 8), need=need(tables["big"]), timeout_s=5)
    share = arbiter.allowance("a")
    assert lease.bytes <= share and arbiter.leased == lease.bytes
    assert not lease.waited and not lease.stepped_down
    assert lease.choice.peak_bytes == tables["big"].plans[
        tables["big"].find(lease.choice.batch, share)].peak_bytes  # the plan its share gives
    arbiter.release(lease)
    arbiter.release(lease)  # twice: nothing more
    assert arbiter.leased == 0 and rec.grants("a") == [lease.bytes]
    assert sum(arbiter.shares().values()) == 60 * MB and arbiter.shares()["c"] == 0


def test_a_batch_steps_down_when_others_hold_part_of_its_share(tables: dict[str, PlanTable]) -> None:
    big, small = tables["big"], tables["small"]
    demand = {"a": 8, "b": 0, "c": 0}
    limit = big.top_bytes + need(small) * 3 // 2
    arbiter, rec = make(tables, limit, demand)
    held = arbiter.acquire("a", picker(big, 8), need=need(big), timeout_s=5)  # a alone: all of it
    assert held.bytes == big.top_bytes
    demand["b"] = 8  # b gets busy: its share is more than what a left free
    share_b = arbiter.allowance("b")
    free = limit - held.bytes
    assert need(small) <= free < share_b
    lease = arbiter.acquire("b", picker(small, 8), need=need(small), timeout_s=5)
    assert lease.stepped_down and not lease.waited and lease.bytes <= free
    assert arbiter.leased == held.bytes + lease.bytes <= limit
    assert ("step_down", "b", 0) in rec.events and arbiter.snapshot().step_downs["b"] == 1
    arbiter.release(held)
    arbiter.release(lease)
    again = arbiter.acquire("b", picker(small, 8), need=need(small), timeout_s=5)
    assert not again.stepped_down and again.bytes > lease.bytes  # the share, now free
    arbiter.release(again)


def test_waiters_are_served_in_order_so_nothing_starves(tables: dict[str, PlanTable]) -> None:
    big, small = tables["big"], tables["small"]
    demand = {"a": 8, "b": 0, "c": 0}
    limit = int(big.row(8).peaks[-1])  # a's fastest plan takes everything
    arbiter, rec = make(tables, limit, demand)
    held = arbiter.acquire("a", picker(big, 8), need=need(big), timeout_s=5)
    assert limit - held.bytes < need(small)  # nothing left for anyone
    demand["c"] = 8
    got: dict[str, object] = {}

    def wait_for(model: str, table: PlanTable) -> None:
        got[model] = arbiter.acquire(model, picker(table, 8), need=need(table), timeout_s=30)

    c = threading.Thread(target=wait_for, args=("c", small))
    c.start()
    assert rec.waiting.wait(10)  # c is in line
    rec.waiting.clear()
    # a's next piece: memory would fit a small plan of a once its lease is back, but c was
    # first; a queues behind it.
    a = threading.Thread(target=wait_for, args=("a", big))
    a.start()
    assert rec.waiting.wait(10)
    assert arbiter.snapshot().waiting == 2
    arbiter.release(held)
    c.join(10)
    a.join(10)
    assert not c.is_alive() and not a.is_alive()
    grants = [m for kind, m, n in rec.events if kind == "lease" and n > 0]
    assert grants == ["a", "c", "a"]  # in the order they asked
    assert got["c"].waited and got["a"].waited  # type: ignore[attr-defined]
    assert arbiter.leased <= limit and arbiter.overcommits == 0
    assert arbiter.snapshot().waits == {"a": 1, "b": 0, "c": 1}
    for lease in got.values():
        arbiter.release(lease)  # type: ignore[arg-type]
    assert arbiter.leased == 0 and arbiter.snapshot().waiting == 0


def test_a_wait_longer_than_the_timeout_gives_up_and_leaves_the_line(
        tables: dict[str, PlanTable]) -> None:
    big, small = tables["big"], tables["small"]
    demand = {"a": 8, "b": 0, "c": 0}
    limit = int(big.row(8).peaks[-1])
    arbiter, _ = make(tables, limit, demand)
    held = arbiter.acquire("a", picker(big, 8), need=need(big), timeout_s=5)
    demand["b"] = 1
    with pytest.raises(LeaseTimeoutError, match="b: waited 0.2 s .* raise the memory limit"):
        arbiter.acquire("b", picker(small, 1), need=need(small), timeout_s=0.2)
    assert arbiter.snapshot().waiting == 0
    arbiter.release(held)
    arbiter.release(arbiter.acquire("b", picker(small, 1), need=need(small), timeout_s=5))


def test_a_model_that_cannot_fit_one_sample_is_told_at_once(tables: dict[str, PlanTable]) -> None:
    big = tables["big"]
    arbiter, _ = make(tables, need(big) - 1, {"a": 1, "b": 0, "c": 0})
    with pytest.raises(InfeasibleError, match="a: its smallest plan .* needs .* 1 bytes more"):
        arbiter.acquire("a", picker(big, 1), need=need(big), timeout_s=5)
    with pytest.raises(UsageError, match="memory_sharing 'fair'"):
        Arbiter("cpu", MemoryProbe("cpu", limit=1).free, mode="fair")


def test_static_shares_are_equal_whatever_the_demand(tables: dict[str, PlanTable]) -> None:
    demand = {"a": 8, "b": 0, "c": 0}
    arbiter, _ = make(tables, 60 * MB, demand, mode="static")
    assert arbiter.allowance("a") == arbiter.allowance("b") == 20 * MB
    lease = arbiter.acquire("a", picker(tables["big"], 8), need=need(tables["big"]), timeout_s=5)
    assert lease.bytes <= 20 * MB
    arbiter.release(lease)


def test_serial_models_each_get_the_whole_budget(tables: dict[str, PlanTable]) -> None:
    arbiter, _ = make(tables, 60 * MB, {"a": 8, "b": 8, "c": 8}, serial=True)
    assert {m: arbiter.allowance(m) for m in "abc"} == {m: 60 * MB for m in "abc"}


def test_without_sharing_two_models_plan_for_the_same_bytes(tables: dict[str, PlanTable]) -> None:
    """Mode none (the old behaviour): not enforced, and the overcommit is counted."""
    big, small = tables["big"], tables["small"]
    limit = 60 * MB
    arbiter, rec = make(tables, limit, {"a": 8, "b": 8, "c": 0}, mode="none")
    a = arbiter.acquire("a", picker(big, 8), need=need(big), timeout_s=5)
    b = arbiter.acquire("b", picker(small, 8), need=need(small), timeout_s=5)
    assert a.bytes == big.plans[big.find(8, limit)].peak_bytes  # each planned for all of it
    assert a.bytes + b.bytes > limit and arbiter.overcommits == 1 and arbiter.min_headroom < 0
    assert ("overcommit", "cpu", 0) in rec.events
    arbiter.release(a)
    arbiter.release(b)


# --------------------------------------------------------------------------- real workers


def _worker(name: str, arbiter: Arbiter, demand: dict[str, int]) -> Worker:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec(name, input_shape=(3, 32, 32))))
    profile = measure(cap, ProfileOptions(batch_max=4, repeats=1, warmup=0), progress=False)
    table = build_table(profile, slot_count=64)
    worker = Worker(cap, table, MemoryProbe("cpu"), name=name, memory=arbiter,
                    lease_timeout_s=60)
    arbiter.register(name, lambda: worker.table, lambda: demand[name])
    return worker


def test_real_workers_at_once_never_lease_more_than_the_budget() -> None:
    """Three real models, each on its own thread, batches at once: every grant is checked
    (the sum of live leases against the budget), outputs equal model(x), and every model ran
    while the others held memory."""
    names = ("squeezenet1_0", "mobilenet_v2", "resnet18")
    demand = {n: 0 for n in names}
    recorder = Recorder()
    probe_limit = [0]
    arbiter = Arbiter("cpu", lambda: MemoryProbe("cpu", limit=probe_limit[0]).free(),
                      listener=recorder)
    recorder.arbiter = arbiter
    workers = {n: _worker(n, arbiter, demand) for n in names}
    tops = {n: w.table.top_bytes for n, w in workers.items()}
    # Each model alone could run its fastest plan; the three together cannot.
    probe_limit[0] = max(tops.values()) // 2 + sum(int(w.table.min_peaks[3]) for w in workers.values())
    assert sum(tops.values()) > probe_limit[0]
    start = threading.Barrier(len(names))
    errors: list[BaseException] = []

    def serve(name: str) -> None:
        worker = workers[name]
        module = worker.capture.model.module
        try:
            start.wait(30)
            for seed in range(6):
                x = worker.capture.model.example(4, seed=seed)
                demand[name] = 4
                y, info = worker.infer(x)
                demand[name] = 0
                with torch.inference_mode():
                    torch.testing.assert_close(y, module(x), rtol=1e-4, atol=1e-4)
                assert sum(c.batch for c in info.choices) == 4
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    snap = arbiter.snapshot()
    assert snap.grants >= 18 and snap.overcommits == 0
    assert snap.min_headroom_bytes is not None and snap.min_headroom_bytes >= 0
    assert snap.high_water_bytes <= probe_limit[0] and snap.leased_bytes == 0
    assert all(recorder.grants(n) for n in names)


def test_a_lease_is_returned_when_the_batch_fails() -> None:
    """A batch whose plan fails on the device (here: samples of the wrong shape) gives its
    lease back: the next batch gets the memory."""
    demand = {"squeezenet1_0": 1}
    arbiter = Arbiter("cpu", MemoryProbe("cpu", limit=64 * MB).free)
    worker = _worker("squeezenet1_0", arbiter, demand)
    with pytest.raises(ExecutionError, match="squeezenet1_0"):
        worker.infer(torch.zeros(2, 4, 32, 32))  # 4 channels: the first conv refuses them
    assert arbiter.grants == 1 and arbiter.leased == 0
    y, info = worker.infer(worker.capture.model.example(2))
    assert arbiter.grants == 2 and arbiter.leased == 0 and info.choices[0].peak_bytes > 0
