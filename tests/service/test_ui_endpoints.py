"""The page's JSON and files over real HTTP: ``GET /ui``, its icon, ``/models/{name}/curves``,
``/models/{name}/tree``, ``/models/{name}/stats`` (the browser tests are in tests/ui/)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from planner.solver.compare import unit_uses
from core.tree import iter_nodes
from service.main import create_app
from tests.service.conftest import TINY_SHAPE, ServerThread, assert_error, settings_for

KEY = "ui-endpoints-key-0123"


@pytest.fixture(scope="module")
def server(vbs_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = settings_for(vbs_cache, tmp_path_factory.mktemp("ui") / "store", api_key=KEY)
    with ServerThread(create_app(settings)) as started:
        yield started


@pytest.fixture(scope="module")
def keyed(server: ServerThread) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_the_page_and_its_files_are_served_without_a_key(client: httpx.Client) -> None:
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "ui"
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'href="ui/ui.css"' in page.text and 'src="ui/ui.js"' in page.text
    for name, kind in (("ui.js", "text/javascript"), ("ui.css", "text/css")):
        got = client.get(f"/ui/{name}")
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind)
        assert len(got.content) > 1000
    assert_error(client.get("/ui/secrets.txt"), 404, "asset_name", "secrets.txt", "ui.js")


def test_the_page_links_its_icon_and_the_icon_is_served(client: httpx.Client) -> None:
    """Browsers ask for /favicon.ico on every load of the page: an image, not a 404."""
    page = client.get("/ui")
    head = page.text.split("</head>")[0]
    assert '<link rel="icon" href="favicon.ico"' in head  # relative: /favicon.ico from /ui
    icon = client.get(httpx.URL(str(page.url)).join("favicon.ico"))
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/")
    image = Image.open(io.BytesIO(icon.content))
    assert image.format == "ICO" and {(16, 16), (32, 32), (48, 48)} <= image.info["sizes"]


def test_curves_are_the_table_rows(server: ServerThread, keyed: httpx.Client) -> None:
    entry = server.app.state.registry.entries["tiny"]
    for r in (1, entry.table.batch_max):
        body = keyed.get("/models/tiny/curves", params={"batch": r}).json()
        assert body["batch"] == r and body["table_solver"] == "vbs"
        assert list(body["strategies"]) == ["vbs", "paper", "greedy", "fbs", "fbs-best"]
        for solver, points in body["strategies"].items():
            table = entry.tables[solver]
            row = table.row(r)
            assert [p["bytes"] for p in points] == row.peaks.tolist()
            assert [p["plan_id"] for p in points] == [table.plans[i].plan_id for i in row.plans]
            assert [p["time_per_sample_s"] for p in points] == pytest.approx(
                [table.plans[i].time_total / r for i in row.plans])
        assert body["low_bytes"] == min(int(t.min_peaks[r - 1]) for t in entry.tables.values())
        assert body["high_bytes"] == max(int(t.row(r).peaks[-1]) for t in entry.tables.values())
    default = keyed.get("/models/tiny/curves").json()
    assert default["batch"] == entry.table.batch_max


def test_tree_names_every_unit_of_the_table(server: ServerThread, keyed: httpx.Client) -> None:
    entry = server.app.state.registry.entries["tiny"]
    body = keyed.get("/models/tiny/tree").json()
    assert body["model"] == "tiny" and body["fingerprint"] == entry.fingerprint
    names = []
    stack = [body["root"]]
    while stack:
        node = stack.pop()
        assert "time" not in node and "ws" not in node
        if node["kind"] in ("layer", "opaque", "parallel"):
            names.append(node["name"])
        stack.extend(node.get("children", []) + node.get("branches", []))
    assert sorted(names) == sorted(entry.table.units)
    assert sorted(names) == sorted(n.name for n in iter_nodes(entry.prepared.profile.root)
                                   if type(n).__name__ in ("Layer", "Parallel"))


def test_stats_follow_requests(server: ServerThread, keyed: httpx.Client) -> None:
    entry = server.app.state.registry.entries["tiny"]
    before = keyed.get("/models/tiny/stats").json()
    assert before["model"] == "tiny" and before["memory_free_bytes"] > 0
    assert before["table"]["version"] == entry.table_version
    assert before["table"]["id"] == entry.table_id and before["table"]["loaded_at"] > 0
    x = np.random.default_rng(0).standard_normal((3, *TINY_SHAPE)).astype(np.float32)
    ran = keyed.post("/infer", json={"inputs": x.tolist()})
    assert ran.status_code == 200, ran.text
    after = keyed.get("/models/tiny/stats").json()
    assert after["samples_total"] == before["samples_total"] + 3
    assert after["requests"] >= 1 and after["samples"] >= 3 and after["samples_per_s"] > 0
    assert 0 < after["latency_p50_s"] <= after["latency_p99_s"]
    last = after["last_batch"]
    ran_plan = ran.json()["plan"]
    assert last["plan_id"] == ran_plan["plan_id"] and last["samples"] == 3
    assert last["budget_bytes"] == ran_plan["budget_bytes"]
    assert last["peak_bytes"] == ran_plan["peak_bytes"] and last["table_version"] == 1
    assert last["plan_id"] in {p.plan_id for p in entry.table.plans}
    assert after["table"]["loaded_at"] == before["table"]["loaded_at"]  # the same table
    assert after["oom_retries_total"] == 0 and after["queue"] == 0


def test_the_plan_data_needs_the_key(client: httpx.Client) -> None:
    for path in ("/models/tiny/curves", "/models/tiny/tree", "/models/tiny/stats"):
        assert_error(client.get(path), 401, "API key")
        assert_error(client.get(path, headers={"Authorization": "Bearer wrong-key-123"}), 401,
                     "not valid")


def test_bad_input_is_named(keyed: httpx.Client) -> None:
    assert_error(keyed.get("/models/tiny/curves", params={"batch": 9}), 400, "batch", "1..4")
    assert_error(keyed.get("/models/tiny/curves", params={"batch": "x"}), 400, "batch")
    for path in ("/models/nope/curves", "/models/nope/tree", "/models/nope/stats"):
        assert_error(keyed.get(path), 404, "nope", "tiny")


def test_plan_descriptions_are_shared_with_plan(server: ServerThread, keyed: httpx.Client) -> None:
    """/plan's units are the planner's description of the plan (planner.view.data)."""
    entry = server.app.state.registry.entries["tiny"]
    table = entry.table
    budget = int(table.row(4).peaks[0])
    body = keyed.get("/plan", params={"mem": budget, "batch": 4}).json()
    index = table.find(4, budget)
    assert [(u["unit"], u["batches"], u["need_bytes"]) for u in body["plan"]["units"]] == [
        (u.name, list(u.batches), u.need_bytes) for u in unit_uses(table, index)]
