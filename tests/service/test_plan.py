"""``GET /plan``: the table's plan for a budget and request size, FBS and Greedy beside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from core.errors import InfeasibleError
from planner.solver.tables import CALL_MARGIN
from service.main import create_app
from tests.service.conftest import ServerThread, assert_error, settings_for


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("plan") / "store")
    with ServerThread(create_app(settings)) as started:
        yield started


def test_plan_matches_the_table_and_the_baselines(server: ServerThread, client: httpx.Client) -> None:
    entry = server.app.state.registry.entries["tiny"]
    table = entry.table
    plans = table.plans_for(4)
    # a budget between the smallest and the largest plan of 4 samples: the plan is constrained
    budget = (plans[0][0] + plans[-1][0]) // 2
    r = client.get("/plan", params={"mem": str(budget), "batch": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and body["batch"] == 4 and body["memory_budget"] == budget
    assert body["memory_source"] == "query" and body["table_version"] == 1
    assert body["table_id"] == f"{entry.fingerprint}.vbs.time" and body["baseline"] == "fbs-best"
    want = table.lookup(4, budget)
    plan = body["plan"]
    assert plan["feasible"] and plan["plan_id"] == want.plan_id
    assert plan["time_total_s"] == pytest.approx(want.time_total)
    assert plan["time_per_sample_s"] == pytest.approx(want.time_total / 4)
    assert plan["throughput_per_s"] == pytest.approx(4 / want.time_total)
    # the table's exact figure: what the executor allocates, within the budget
    assert plan["peak_bytes"] == plan["breakpoint_bytes"] == want.peak_bytes <= budget
    assert plan["unused_bytes"] == budget - plan["peak_bytes"]
    assert "program" not in plan  # only when asked (?program=true)
    full = client.get("/plan", params={"mem": str(budget), "batch": 4, "program": "true"}).json()
    assert full["plan"]["program"] == want.program.to_json()
    assert all("program" in full[s] for s in ("fbs", "fbs-best") if full[s]["feasible"])
    seen = [u["unit"] for u in plan["units"]]
    assert seen == list(dict.fromkeys(s.unit for s in want.program.steps))  # execution order
    for unit in plan["units"]:
        assert sum(unit["batches"]) == 4
        assert unit["batches"] == [s.samples for s in want.program.steps if s.unit == unit["unit"]]
        assert 0 < unit["need_bytes"] <= plan["peak_bytes"]
        assert unit["unused_bytes"] == budget - unit["need_bytes"] >= 0
    for solver in ("paper", "greedy", "fbs", "fbs-best"):
        got = body[solver]
        assert got["solver"] == solver
        try:
            direct = entry.tables[solver].lookup(4, budget)
        except InfeasibleError as exc:  # a baseline may need more memory than the vbs plan
            assert got["feasible"] is False and got["reason"] == " ".join(str(exc).split())
            assert got["needs_bytes"] == int(entry.tables[solver].min_peaks[3]) > budget
            assert body["gain"][solver] is None
            continue
        assert got["feasible"] and got["plan_id"] == direct.plan_id
        assert got["peak_bytes"] == direct.peak_bytes <= budget
        assert got["time_total_s"] == pytest.approx(direct.time_total)
        assert body["gain"][solver] == pytest.approx(direct.time_total / want.time_total)
        # vbs is never slower by the tables, but for a plan of fewer calls kept within the
        # table's margin of the row's least cost (planner.solver.tables.CALL_MARGIN)
        assert body["gain"][solver] >= (1 - CALL_MARGIN) / (1 + CALL_MARGIN) - 1e-12
    # the same question again is answered identically
    assert client.get("/plan", params={"mem": str(budget), "batch": 4}).json() == body


def test_plan_and_infer_are_lookups_only(server: ServerThread, client: httpx.Client,
                                        no_planning) -> None:
    """Every budget from nothing to beyond the top, every request size: no DP, no walk, no
    simulation, for /plan and for inference (batches split by the table included)."""
    entry = server.app.state.registry.entries["tiny"]
    table = entry.table
    for n in (1, 3, 4, 9):  # 9 is more than the table's largest request: it runs in pieces
        x = np.random.default_rng(n).standard_normal((n, 3, 8, 8)).astype(np.float32)
        r = client.post("/infer", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text
        assert r.json()["samples"] == n
    budgets = sorted({0, 1, table.top_bytes * 2} | {int(b) + d for r in range(1, 5)
                                                    for b in table.row(r).peaks for d in (-1, 0)})
    for r in range(1, 5):
        for mem in budgets:
            body = client.get("/plan", params={"mem": str(mem), "batch": r}).json()
            assert body["plan"]["feasible"] == (mem >= table.min_peaks[r - 1])


def test_plan_units_and_the_memory_free_now(client: httpx.Client) -> None:
    a = client.get("/plan", params={"mem": "0.03MB", "batch": 2}).json()
    b = client.get("/plan", params={"mem": "30000", "batch": "2"}).json()
    assert a["memory_budget"] == b["memory_budget"] == 30_000 and a["plan"] == b["plan"]
    now = client.get("/plan").json()  # no mem: the model's share now; no batch: the largest
    assert now["memory_source"] == "share (arbiter)" and now["memory_budget"] > 0
    assert now["batch"] == 4
    # One model on one (shared) thread: its share is all the memory free for plans.
    assert now["memory_shares"] == {"tiny": now["memory_budget"]}
    assert now["memory_free_for_plans"] == now["memory_budget"]
    assert now["plan"]["feasible"]
    assert client.get("/plan", params={"mem": "64MiB", "model": "tiny"}).status_code == 200


def test_plan_when_nothing_fits(server: ServerThread, client: httpx.Client) -> None:
    tables = server.app.state.registry.entries["tiny"].tables
    body = client.get("/plan", params={"mem": "100", "batch": 4}).json()
    for key in ("plan", "paper", "greedy", "fbs", "fbs-best"):
        answer = body[key]
        solver = "vbs" if key == "plan" else key
        assert answer["feasible"] is False and "needs at least" in answer["reason"]
        assert answer["needs_bytes"] == int(tables[solver].min_peaks[3])
        assert f"needs at least {answer['needs_bytes']} bytes" in answer["reason"]
    assert body["gain"] == {"paper": None, "greedy": None, "fbs": None, "fbs-best": None}


@pytest.mark.parametrize("params,status,words", [
    ({"mem": "lots"}, 400, ["mem", "lots"]),
    ({"mem": "30XB"}, 400, ["mem", "XB"]),
    ({"mem": "-5"}, 400, ["mem"]),
    ({"batch": "0"}, 400, ["batch", "1..4"]),
    ({"batch": "99"}, 400, ["batch", "1..4"]),
    ({"batch": "two"}, 400, ["batch"]),
    ({"model": "nope"}, 404, ["nope"]),
])
def test_plan_bad_parameters(client: httpx.Client, params: dict[str, str], status: int,
                             words: list[str]) -> None:
    assert_error(client.get("/plan", params=params), status, *words)
