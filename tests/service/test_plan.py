"""``GET /plan``: the table's plan for a budget and request size, FBS and Greedy beside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from planner.errors import InfeasibleError
from planner.solver.simulate import simulate
from planner.solver.solve import solve
from service.main import create_app
from tests.service.conftest import ServerThread, assert_error, settings_for


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("plan") / "store")
    with ServerThread(create_app(settings)) as started:
        yield started


def test_plan_matches_the_table_and_the_baselines(server: ServerThread, client: httpx.Client) -> None:
    entry = server.app.state.registry.entries["tiny"]
    table, profile = entry.table, entry.prepared.profile
    plans = table.plans_for(4)
    # a budget between the smallest and the largest plan of 4 samples: the plan is constrained
    budget = (plans[0][0] + plans[-1][0]) // 2
    r = client.get("/plan", params={"mem": str(budget), "batch": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and body["batch"] == 4 and body["memory_budget"] == budget
    assert body["memory_source"] == "query" and body["table_version"] == 1
    want = table.lookup(4, budget)
    plan = body["plan"]
    assert plan["feasible"] and plan["plan_id"] == want.plan_id
    assert plan["time_total_s"] == pytest.approx(want.time_total)
    assert plan["time_per_sample_s"] == pytest.approx(want.time_total / 4)
    assert plan["throughput_per_s"] == pytest.approx(4 / want.time_total)
    assert plan["peak_bytes"] <= budget
    sim = simulate(profile, want.program, 4, budget, slot_bytes=table.slot_bytes)
    assert plan["units"] == [{"unit": u.name, "batches": list(u.batches),
                              "unused_bytes": list(u.unused_bytes)} for u in sim.units]
    for unit in plan["units"]:
        assert sum(unit["batches"]) == 4 and all(b >= 0 for b in unit["unused_bytes"])
    for solver in ("fbs", "greedy"):
        got = body[solver]
        assert got["solver"] == solver
        try:
            direct = solve(profile, 4, budget, solver=solver, slot_bytes=table.slot_bytes)
        except InfeasibleError as exc:  # a baseline may need more memory than the DP's plan
            assert got["feasible"] is False and got["reason"] == " ".join(str(exc).split())
            assert body["gain"][solver] is None
            continue
        assert got["feasible"] and got["plan_id"] == direct.plan_id
        assert got["time_total_s"] == pytest.approx(direct.time_total)
        assert body["gain"][solver] == pytest.approx(direct.time_total / want.time_total)
    # the same question again is answered from the cache, identically
    assert client.get("/plan", params={"mem": str(budget), "batch": 4}).json() == body


def test_plan_units_and_the_memory_free_now(client: httpx.Client) -> None:
    a = client.get("/plan", params={"mem": "0.03MB", "batch": 2}).json()
    b = client.get("/plan", params={"mem": "30000", "batch": "2"}).json()
    assert a["memory_budget"] == b["memory_budget"] == 30_000 and a["plan"] == b["plan"]
    now = client.get("/plan").json()  # no mem: the memory free now; no batch: the largest
    assert now["memory_source"] == "free now" and now["memory_budget"] > 0 and now["batch"] == 4
    assert now["plan"]["feasible"]
    assert client.get("/plan", params={"mem": "64MiB", "model": "tiny"}).status_code == 200


def test_plan_when_nothing_fits(client: httpx.Client) -> None:
    body = client.get("/plan", params={"mem": "100", "batch": 4}).json()
    for key in ("plan", "fbs", "greedy"):
        assert body[key]["feasible"] is False and "bytes" in body[key]["reason"]
    assert body["gain"] == {"fbs": None, "greedy": None}


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
