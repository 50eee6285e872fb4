"""A model without a table served at once (``VBS_FIRST_START=interim``): from a cold store and
a cold profile cache, the service answers from its interim table (equal to ``model(x)``)
while a real `vbs plan` child profiles and solves the model beside it; the planned table is
then swapped in without a restart, under traffic, with every request answered.

The planner is held at a gate file until the test has seen the interim table serve
(``tests.planner.factories.planner_gate``: the service's own process never waits), so the
order is the gate's, not the clock's."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import httpx
import numpy as np
import pytest

from planner.store import open_store
from service.first_start import interim_prepared, planner_env, plan_command
from service.main import create_app
from service.settings import Settings
from tests.planner.factories import PLANNER_GATE_ENV
from tests.service.conftest import TINY_SHAPE, assert_close, reference, run, running, \
    settings_for, wait_until

GATED = "tiny=tests.planner.factories:planner_gated_two_layer@3x8x8"
PLANNED_WITHIN_S = 240.0  # a bound for a stuck planner, not a measure of it


def x_(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *TINY_SHAPE)).astype(np.float32)


def test_a_cold_start_serves_an_interim_table_then_the_planned_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "planner.gate"
    gate.touch()
    monkeypatch.setenv(PLANNER_GATE_ENV, str(gate))
    settings = settings_for(tmp_path / "cache", tmp_path / "store", models=[GATED],
                            first_start="interim")
    app = create_app(settings)

    async def main() -> None:
        async with running(app) as client:
            registry = app.state.registry
            entry = registry.entries["tiny"]
            (model,) = (await client.get("/models")).json()["models"]
            assert model["state"] == "ready" and model["table"]["kind"] == "interim"
            assert model["table"]["solver"] == "interim" and model["table"]["version"] == 0
            assert model["planning"]["state"] == "planning"
            x = x_(3, 0)
            first = (await client.post("/infer", json={"inputs": x.tolist()})).json()
            assert first["table_version"] == 0 and first["plan"]["solver"] == "interim"
            assert_close(first["outputs"], reference(entry, x))
            plan = (await client.get("/plan", params={"mem": "1GB", "batch": 4})).json()
            assert plan["table_solver"] == "interim" and plan["plan"]["feasible"]
            stats = (await client.get("/models/tiny/stats")).json()
            assert stats["table"]["kind"] == "interim"
            assert (await client.get("/models/tiny/tree")).status_code == 200
            await wait_until(lambda: Path(f"{gate}.held").exists(), timeout_s=PLANNED_WITHIN_S,
                             what="the planner at its gate")
            assert entry.interim  # held: it cannot have published
            answers = await _traffic_through_the_swap(client, registry, gate)
            for x, response in answers:  # nothing lost, every output model(x)
                assert response.status_code == 200, response.text
                assert_close(response.json()["outputs"], reference(entry, x))
            versions = {response.json()["table_version"] for _, response in answers}
            assert 0 in versions, versions  # some answered by the interim table
            after = (await client.post("/infer", json={"inputs": x.tolist()})).json()
            assert after["table_version"] >= 1 and after["plan"]["solver"] == "vbs"
            assert_close(after["outputs"], reference(entry, x))
            await wait_until(lambda: entry.planning.state == "published",
                             timeout_s=PLANNED_WITHIN_S, what="the planner's end")
            await _check_planned(client, app, settings)

    run(main(), timeout_s=2 * PLANNED_WITHIN_S)


async def _traffic_through_the_swap(client: httpx.AsyncClient, registry: object, gate: Path
                                    ) -> list[tuple[np.ndarray, httpx.Response]]:
    """Two clients sending requests from before the planner is let go until after its table
    is swapped in; every (input, answer)."""
    answers: list[tuple[np.ndarray, httpx.Response]] = []
    swapped = asyncio.Event()

    async def traffic(seed: int) -> None:
        for i in itertools.count():
            x = x_(1 + (seed + i) % 4, seed * 10_000 + i)
            answers.append((x, await client.post("/infer", json={"inputs": x.tolist()})))
            if swapped.is_set():
                return
            await asyncio.sleep(0.02)  # paced: the planner shares the two cores

    async def swap() -> None:
        await wait_until(lambda: len(answers) >= 4, what="traffic before the planner goes on")
        gate.unlink()  # the planner goes on: profiles, solves, publishes
        await registry.wait_table("tiny", 1, timeout_s=PLANNED_WITHIN_S)  # type: ignore[attr-defined]
        swapped.set()

    await asyncio.gather(swap(), traffic(1), traffic(2))
    return answers


async def _check_planned(client: httpx.AsyncClient, app: object, settings: Settings) -> None:
    """/models, /plan and the store once the planned table serves."""
    (model,) = (await client.get("/models")).json()["models"]
    assert model["table"]["kind"] == "planned" and model["table"]["solver"] == "vbs"
    assert model["table"]["version"] >= 1 and model["planning"]["state"] == "published"
    assert model["planning"]["pid"] and model["planning"]["elapsed_s"] > 0
    assert model["table"]["compared"] == ["fbs", "fbs-best", "greedy", "paper"]
    plan = (await client.get("/plan", params={"mem": "1GB", "batch": 4})).json()
    assert plan["table_solver"] == "vbs" and plan["fbs-best"]["feasible"]
    entry = app.state.registry.entries["tiny"]  # type: ignore[attr-defined]
    assert "interim" not in entry.profile.meta and entry.prepared.solver == "vbs"
    assert app.state.metrics.value("vbs_table_reloads_total", {"model": "tiny"}) == 1  # type: ignore[attr-defined]
    with open_store(settings.store_location) as store:  # the interim table is never stored
        assert not any(".interim." in t.fingerprint for t in store.list_tables())


def test_the_planner_gets_the_services_settings_off_its_command_line(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path, store="redis://:secret@localhost:6379/0",
                        batch_max=5, profile_repeats=2, runtime="onnxruntime", threads=1,
                        models=[GATED], first_start="interim")
    (served, name, shape), = settings.served_models
    from core.spec import ModelSpec

    command = plan_command(served, ModelSpec(name=name, input_shape=shape))
    assert command[4:] == ("plan", "--model",
                           "tiny=tests.planner.factories:planner_gated_two_layer@3,8,8", "--quiet")
    assert "secret" not in " ".join(command)  # the store's password: in its environment
    env = planner_env(settings, {"VBS_WEIGHTS": "/nowhere", "HOME": "/home/x"})
    assert env["VBS_STORE"] == "redis://:secret@localhost:6379/0" and env["HOME"] == "/home/x"
    assert (env["VBS_BATCH_MAX"], env["VBS_PROFILE_REPEATS"], env["VBS_RUNTIME"],
            env["VBS_THREADS"], env["VBS_CACHE_DIR"]) == ("5", "2", "onnxruntime", "1",
                                                          str(tmp_path))
    assert "VBS_WEIGHTS" not in env and env["VBS_PROFILE_GRID"] == "false"


def test_no_interim_table_where_torch_alone_is_asked_for() -> None:
    assert Settings().first_start == "wait"
    assert interim_prepared("tiny", None, Settings(runtime="torch"), None) is None
