"""``vbs show --html``: the page as one file, for a profile without a running service.

The file is written by the CLI (``vbs``'s main, in this process) from a profile (a GoogLeNet-like tree with inception
blocks), opened from disk in chromium with nothing served, and must show, at budgets set
with the keyboard, what the planner's own comparison (``planner.solver.compare``) gives from
the same tables; it fetches nothing (offline).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from planner.solver.compare import compare
from planner.solver.synthetic import googlenet_like
from planner.solver.tables import build_tables
from core.tree import save_profile
from tests.ui.conftest import Served, open_page, vbs_main

STRATEGIES = ("vbs", "paper", "greedy", "fbs", "fbs-best")
SLOTS = 32


def vbs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str,
        **env: str) -> tuple[int, str, str]:
    """The ``vbs`` command in this process (its ``main``), with ``env`` as VBS_* settings."""
    monkeypatch.setenv("VBS_SLOT_COUNT", str(SLOTS))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = vbs_main()(list(args))
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def embedded(path: Path) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="vbs-data">(.*?)</script>',
                      path.read_text(), re.S)
    assert found, "no embedded data"
    return json.loads(found.group(1))


def test_the_file_shows_the_planners_comparison_offline(
        browser: Any, tmp_path: Path, shot: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    profile = googlenet_like(batch_max=3)
    source = tmp_path / "googlenet-like.json"
    save_profile(profile, source)
    out = tmp_path / "plans.html"
    code, printed, errors = vbs(capsys, monkeypatch, "show", "--profile", str(source),
                                "--html", str(out))
    assert code == 0, errors
    assert str(out) in printed and "no service needed" in printed
    text = out.read_text()
    assert "ui/ui.js" not in text and "ui/ui.css" not in text  # inlined, nothing to fetch
    assert embedded(out)["books"][0]["sizes"] == [1, 2, 3]
    tables = build_tables(profile, STRATEGIES, slot_count=SLOTS)  # as the CLI built them

    page = open_page(browser, out.as_uri())
    fetched: list[str] = []
    page.on("request", lambda q: fetched.append(q.url))
    try:
        sec = page.locator("section.model[data-model='googlenet-like']")
        sec.locator("[data-role=summary][data-budget]").wait_for(state="attached")
        assert sec.locator("[data-role=live-note]").is_visible()
        assert sec.locator("[data-role=to-free]").is_hidden()
        slider = sec.locator("[data-role=memory]")
        for r in (3, 1):
            sec.locator("[data-role=batch]").select_option(str(r))
            sec.locator(f"[data-role=summary][data-batch='{r}']").wait_for(state="attached")
            for s in STRATEGIES:
                shown = sec.locator(f"circle.point[data-strategy='{s}']").evaluate_all(
                    "cs => cs.map(c => Number(c.dataset.bytes))")
                assert shown == tables[s].row(r).peaks.tolist()
            slider.focus()
            for keys in (["End"], ["Home"], ["ArrowRight"] * 9, ["PageUp"] * 3, ["ArrowLeft"]):
                for key in keys:
                    page.keyboard.press(key)
                budget = int(slider.input_value())
                sec.locator(f"[data-role=summary][data-budget='{budget}'][data-batch='{r}']"
                            ).wait_for(state="attached")
                want = compare(tables, r, budget)
                for o in want.outcomes:
                    cell = sec.locator(f"tr[data-strategy='{o.solver}'] [data-role=plan-id]")
                    assert cell.inner_text() == (o.plan.plan_id if o.plan else "-")
                vbs_plan = want.outcome("vbs")
                rows = sec.locator("g.unit-row").evaluate_all("""rs => rs.map(g => [
                    g.dataset.unit, g.dataset.batches, Number(g.dataset.unused),
                    g.dataset.runtime])""")
                assert sorted(rows) == sorted(
                    [u.name, ",".join(map(str, u.batches)), budget - u.need_bytes,
                     "+".join(u.runtimes) or "torch"] for u in vbs_plan.units)
                assert sec.locator("g.phase").count() == sum(len(u.batches) for u in vbs_plan.units)
        # inception blocks: four branches each, grouped under their block
        assert sec.locator("g.branch-row").count() == 4 * sum(
            1 for u in vbs_plan.units if u.name.startswith("inc") and "_" not in u.name)
        assert fetched == [], f"the file fetched {fetched}"
        assert not page.script_errors, page.script_errors
        shot(page, "static")
    finally:
        page.context.close()


def test_the_file_from_the_store_holds_every_model(
        served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "served.html"
    env = {"VBS_CACHE_DIR": str(served.store.parent / "cache"), "VBS_STORE": str(served.store),
           "VBS_BATCH_MAX": "4", "VBS_PROFILE_REPEATS": "1", "VBS_PROFILE_WARMUP": "0",
           "VBS_SLOT_COUNT": "64"}
    code, _, errors = vbs(capsys, monkeypatch, "show", "--model",
                          "branchy=tests.ui.models:branchy@3x16x16", "--model",
                          "tiny=tests.planner.factories:two_layer@3x8x8", "--batch", "2",
                          "--html", str(out), **env)
    assert code == 0, errors
    books = embedded(out)["books"]
    assert [b["name"] for b in books] == ["branchy", "tiny"]
    assert all(b["sizes"] == [2] and list(b["strategies"]) == list(STRATEGIES) for b in books)
    with served.client() as api:  # the same tables the service serves (read from its store)
        for b in books:
            curves = api.get(f"/models/{b['name']}/curves", params={"batch": 2}).json()
            for s, points in curves["strategies"].items():
                assert b["strategies"][s]["rows"]["2"]["peaks"] == [p["bytes"] for p in points]


@pytest.mark.parametrize("args, words", [
    (["show", "--html", "x.html"], "no model given"),
    (["show", "--profile", "p.json", "--model", "m", "--html", "x.html"], "not both"),
    (["show", "--model", "m"], "--memory and --batch"),
])
def test_the_cli_names_what_is_missing(args: list[str], words: str,
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, errors = vbs(capsys, monkeypatch, *args, VBS_MODELS="")
    assert code == 2 and words in errors, errors


def test_an_unwritable_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "p.json"
    save_profile(googlenet_like(batch_max=1), source)
    target = tmp_path / "missing-dir" / "x.html"
    code, _, errors = vbs(capsys, monkeypatch, "show", "--profile", str(source), "--html",
                          str(target))
    assert code == 2 and f"--html {target}" in errors, errors
