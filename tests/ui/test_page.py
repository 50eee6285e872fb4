"""The page in a real browser against a real ``vbs serve``: the plan shown is /plan's for the
slider's budget, the charts have a bar per phase and a point per plan, the live figures move
under load, the API key is asked for once, errors are readable, and the basics of access
(labelled controls, a keyboard slider, contrast of every text)."""

from __future__ import annotations

import concurrent.futures
import re
import time
from typing import Any

import numpy as np

from core.table import PlanTable
from planner.store import open_store
from planner.store.keys import table_id
from tests.ui.conftest import KEY, Served, open_page

STRATEGIES = ("vbs", "paper", "greedy", "fbs", "fbs-best")


def fmt_seconds(s: float) -> str:
    """The page's reading of a time (fmtSeconds in ui.js)."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def stored_tables(served: Served, model: str) -> dict[str, PlanTable]:
    """Every strategy's table of ``model`` as the store holds it (not through the service)."""
    with served.client() as c:
        fingerprint = next(m["fingerprint"] for m in c.get("/models").json()["models"]
                           if m["name"] == model)
    store = open_store(str(served.store))
    try:
        return {s: PlanTable.from_bytes(store.get_table(table_id(fingerprint, s, "time")).blob)
                for s in STRATEGIES}
    finally:
        store.close()


def section(page: Any, model: str) -> Any:
    return page.locator(f"section.model[data-model='{model}']")


def rendered(sec: Any, budget: int, r: int) -> None:
    """Wait until the section shows the plan for ``budget`` and ``r``."""
    sec.locator(f"[data-role=summary][data-budget='{budget}'][data-batch='{r}']").wait_for(
        state="attached")


def shown_rows(sec: Any) -> list[dict[str, Any]]:
    return sec.locator("g.unit-row").evaluate_all("""rows => rows.map(g => ({
        unit: g.dataset.unit, kind: g.dataset.kind, depth: Number(g.dataset.depth),
        batches: g.dataset.batches.split(',').map(Number), unused: Number(g.dataset.unused),
        phases: [...g.querySelectorAll('g.phase')].map(p => Number(p.dataset.samples)),
        runtime: g.dataset.runtime,
        shown_runtime: g.querySelector('.unit-runtime').textContent.trim(),
        title: g.querySelector('title').textContent}))""")


def check_plan(sec: Any, answer: dict[str, Any]) -> None:
    """What the section shows is ``answer`` (a /plan answer): id, time, every unit and bar."""
    plan = answer["plan"]
    assert plan["feasible"], plan
    headline = sec.locator("[data-role=summary] .headline")
    assert headline.locator("[data-role=plan-id]").inner_text() == plan["plan_id"]
    assert headline.locator("[data-role=time-per-sample]").inner_text() == \
        fmt_seconds(plan["time_per_sample_s"])
    rows = shown_rows(sec)
    assert [(r["unit"], r["batches"], r["unused"], r["runtime"]) for r in rows] == [
        (u["unit"], u["batches"], u["unused_bytes"], u["runtime"]) for u in plan["units"]]
    for row in rows:
        assert row["phases"] == row["batches"]  # one bar per phase, in order
        # the unit's runtime beside its name, and in its tooltip
        assert row["shown_runtime"] == {"onnxruntime": "ort"}.get(row["runtime"], row["runtime"])
        assert f"on {row['runtime']}" in row["title"]
        assert row["title"].startswith(f"{row['unit']}: phases of ")
    assert sec.locator("g.phase").count() == sum(len(u["batches"]) for u in plan["units"])
    assert sec.locator("rect.unused").count() == len(plan["units"])
    for s in STRATEGIES:
        if s == answer["table_solver"]:
            continue
        cell = sec.locator(f"tr[data-strategy='{s}'] [data-role=plan-id]").inner_text()
        assert cell == (answer[s]["plan_id"] if answer[s]["feasible"] else "-")


def test_the_plan_shown_is_plans_answer_for_the_slider(page: Any, served: Served,
                                                       shot: Any) -> None:
    sec = section(page, "branchy")
    tables = stored_tables(served, "branchy")
    slider = sec.locator("[data-role=memory]")
    batch = sec.locator("[data-role=batch]")
    sec.locator("[data-role=summary][data-budget]").wait_for(state="attached")
    with served.client() as api:
        for r in (4, 2):
            if batch.input_value() != str(r):
                batch.select_option(str(r))
            sec.locator(f"[data-role=summary][data-batch='{r}']").wait_for(state="attached")
            low = min(int(t.min_peaks[r - 1]) for t in tables.values())
            high = max(int(t.row(r).peaks[-1]) for t in tables.values())
            assert int(slider.get_attribute("min")) == low
            assert high <= int(slider.get_attribute("max")) < high + int(slider.get_attribute("step"))
            for s in STRATEGIES:  # a point per plan of the row, at its breakpoint
                points = sec.locator(f"circle.point[data-strategy='{s}']")
                assert points.evaluate_all("cs => cs.map(c => Number(c.dataset.bytes))") == \
                    tables[s].row(r).peaks.tolist()
            slider.focus()
            seen = set()
            step = int(slider.get_attribute("step"))
            vbs_peaks = tables["vbs"].row(r).peaks.tolist()
            # from the bottom, as many steps as reach the vbs table's second plan
            to_second = -(-(vbs_peaks[min(1, len(vbs_peaks) - 1)] - low) // step)
            for keys in (["End"], ["Home"], ["ArrowRight"] * to_second, ["ArrowLeft"],
                         ["PageUp"] * 2, ["End", "PageDown"]):
                for key in keys:
                    page.keyboard.press(key)
                budget = int(slider.input_value())
                rendered(sec, budget, r)
                answer = api.get("/plan", params={"model": "branchy", "mem": budget, "batch": r,
                                                  "program": "true"}).json()
                check_plan(sec, answer)
                assert answer["plan"]["plan_id"] == \
                    tables["vbs"].plans[tables["vbs"].find(r, budget)].plan_id
                assert slider.get_attribute("aria-valuetext").endswith(f"({budget} bytes)")
                marker = sec.locator("g.budget-marker")
                assert int(marker.get_attribute("data-bytes")) == budget
                seen.add(answer["plan"]["plan_id"])
            assert len(seen) >= min(2, len(vbs_peaks)), seen  # the slider crossed a plan change
    # the block's branches are grouped under it, in the model's order
    rows = shown_rows(sec)
    assert [(r["unit"], r["depth"]) for r in rows] == [
        ("stem", 0), ("cat", 0), ("left_2", 2), ("right_reduce", 2), ("right", 2), ("head", 0),
        ("fc", 0)]
    assert rows[1]["kind"] == "block"
    assert sec.locator("g.branch-row").count() == 2
    shot(page, "plan")


def test_live_figures_change_under_a_small_load(page: Any, served: Served, shot: Any) -> None:
    sec = section(page, "tiny")
    served_dd = sec.locator("[data-role=live-served]")
    page.wait_for_function("el => el.textContent !== '-'", arg=served_dd.element_handle())
    before = int(served_dd.inner_text())
    assert sec.locator("[data-role=live-free]").inner_text().endswith(("B", "iB"))
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32).tolist()
    with served.client() as api:
        def send(_: int) -> int:
            answer = api.post("/infer", params={"model": "tiny"}, json={"inputs": x})
            assert answer.status_code == 200, answer.text
            return answer.json()["samples"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            sent = sum(pool.map(send, range(16)))
        total = api.get("/models/tiny/stats").json()["samples_total"]
        plan_ids = {p.plan_id for p in stored_tables(served, "tiny")["vbs"].plans}
    assert total >= before + sent
    page.wait_for_function("([el, want]) => Number(el.textContent) >= want",
                           arg=[served_dd.element_handle(), total])
    throughput = sec.locator("[data-role=live-throughput]").inner_text()
    rate, requests = re.match(r"([\d.]+) samples/s \((\d+) requests", throughput).groups()
    assert float(rate) > 0 and int(requests) >= 16
    p50, p99 = sec.locator("[data-role=live-latency]").inner_text().split(" / ")
    assert p50 != "-" and p99 != "-"
    last = sec.locator("[data-role=live-last-plan]").inner_text()
    assert last.split(" ")[0] in plan_ids
    assert sec.locator("[data-role=live-oom]").inner_text().startswith("0 ")
    assert re.match(r"v\d+ \(vbs, \d+ plans, ", sec.locator("[data-role=live-table]").inner_text())
    assert sec.locator("[data-role=live-loaded]").inner_text() != "-"
    free = sec.locator("g.free-marker")
    free.wait_for(state="attached")
    assert int(free.get_attribute("data-bytes")) > 0
    sec.scroll_into_view_if_needed()
    shot(page, "live")


def test_a_table_published_while_the_page_is_open_shows_up(page: Any, served: Served) -> None:
    """`vbs plan --replan` publishes a new version of tiny's table; the service swaps it in,
    and the page, without a reload, says so and redraws its plans from it."""
    from core.loaded import ModelSpec
    from planner.pipeline import prepare
    from service.settings import Settings

    sec = section(page, "tiny")
    sec.locator("[data-role=summary][data-table-version]").wait_for(state="attached")
    before = int(sec.locator("[data-role=summary]").get_attribute("data-table-version"))
    table_text = sec.locator("[data-role=live-table]")
    page.wait_for_function("([el, v]) => el.textContent.startsWith(`v${v} `)",
                           arg=[table_text.element_handle(), before])
    loaded_before = sec.locator("[data-role=live-loaded]").inner_text()
    settings = Settings(cache_dir=served.store.parent / "cache", store=str(served.store),
                        batch_max=4, profile_repeats=1, profile_warmup=0, slot_count=64)
    store = open_store(str(served.store))
    try:
        prepare(ModelSpec(name="tests.planner.factories:two_layer", input_shape=(3, 8, 8)),
                settings, store, batch_max=4, replan=True, progress=False)
    finally:
        store.close()
    after = before + 1
    page.wait_for_function("([el, v]) => el.textContent.startsWith(`v${v} `)",
                           arg=[table_text.element_handle(), after], timeout=60_000)
    sec.locator(f"[data-role=summary][data-table-version='{after}']").wait_for(state="attached")
    assert sec.locator("[data-role=live-loaded]").inner_text() != loaded_before
    with served.client() as api:
        budget = int(sec.locator("[data-role=summary]").get_attribute("data-budget"))
        answer = api.get("/plan", params={"model": "tiny", "mem": budget, "batch": 4}).json()
    assert answer["table_version"] == after
    check_plan(sec, answer)


def test_the_key_is_asked_once_and_errors_read_as_messages(browser: Any, served: Served,
                                                           shot: Any) -> None:
    requests: list[tuple[str, str | None]] = []
    statuses: list[tuple[str, int, str | None]] = []  # url, status, the key the request carried
    page = open_page(browser, f"{served.url}/ui")
    try:
        page.on("request", lambda q: requests.append((q.url, q.headers.get("authorization"))))
        page.on("response", lambda a: statuses.append(
            (a.url, a.status, a.request.headers.get("authorization"))))
        form = page.locator("#key-form")
        form.wait_for(state="visible")
        assert page.locator("label[for=api-key]").inner_text() == "API key"
        page.fill("#api-key", "not-the-key-000")
        page.click("#key-form button")
        error = page.locator("#key-error")
        error.wait_for(state="visible")
        assert "refused" in error.inner_text() and "not valid" in error.inner_text()
        assert form.is_visible()
        accepted = len(statuses)
        page.fill("#api-key", KEY)
        page.click("#key-form button")
        form.wait_for(state="hidden")
        sec = section(page, "branchy")
        sec.locator("[data-role=summary][data-budget]").wait_for(state="attached")
        slider = sec.locator("[data-role=memory]")
        slider.focus()
        page.keyboard.press("Home")
        rendered(sec, int(slider.input_value()), 4)
        # two more rounds of live figures: every later request carried the key, none was refused
        page.wait_for_function(
            "() => document.querySelectorAll('[data-role=live-served]')[1].textContent !== '-'")
        stats_before = sum(1 for url, status, _ in statuses
                           if url.endswith("/stats") and status == 200)
        page.wait_for_function(f"() => window.performance.getEntriesByType('resource')"
                               f".filter(e => e.name.endsWith('/stats')).length > {stats_before + 1}")
        later = statuses[accepted:]
        good = f"Bearer {KEY}"
        assert not [u for u, status, key in later if status == 401 and key == good], later
        # a request sent with the refused key and answered after it was replaced (it was in
        # flight) is sent again with the new key and answered
        for url in {u for u, status, _ in later if status == 401}:
            assert any(u == url and status == 200 and key == good for u, status, key in later), later
        assert form.is_hidden()
        keyed = [(u, h) for u, h in requests if "/plan" in u or "/curves" in u or "/stats" in u]
        assert keyed and all(h == f"Bearer {KEY}" for u, h in keyed[-6:])
        # a model that failed to load says why, in words, where its charts would be
        broken = section(page, "broken")
        message = broken.locator("[data-role=error]")
        message.wait_for(state="visible")
        assert "Model broken failed to load: " in message.inner_text()
        assert "torch.fx cannot trace" in message.inner_text()  # the service's reason, verbatim
        assert broken.locator("g.unit-row").count() == 0
        assert not page.script_errors, page.script_errors
        shot(page, "errors", full_page=True)
    finally:
        page.context.close()


def test_memory_shares_are_what_models_reports(page: Any, served: Served) -> None:
    """With several models on one device the arbiter reports shares in GET /models; the page
    shows exactly those (and nothing where the service reports none). Shares follow demand, so
    the page (which re-reads /models every 5 s) is compared with /models until they agree."""
    section(page, "tiny").locator("[data-role=summary][data-budget]").wait_for(state="attached")

    def reported() -> set[tuple[str, str, int]]:
        with served.client() as api:
            memory = api.get("/models").json().get("memory") or []
        return {(d["device"], m, b) for d in memory for m, b in (d.get("shares") or {}).items()}

    def shown() -> set[tuple[str, str, int]]:
        return {tuple(x) for x in page.locator("#shares svg rect.share").evaluate_all(
            "rs => rs.map(r => [r.closest('svg').dataset.device, r.dataset.model, "
            "Number(r.dataset.bytes)])")}

    want = reported()
    if not want:  # no arbiter: no shares section
        assert page.locator("#shares").is_hidden() and shown() == set()
        return
    page.locator("#shares").wait_for(state="visible")
    deadline = time.monotonic() + 30
    while shown() != want:  # the page's next look at /models (every 5 s)
        assert time.monotonic() < deadline, (shown(), want)
        page.wait_for_timeout(250)
        want = reported()
    assert {m for _, m, _ in want} >= {"branchy", "tiny"}


CONTRAST_JS = """() => {
  const visible = el => { const r = el.getBoundingClientRect(); const s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== 'hidden' && s.display !== 'none'; };
  const background = el => {
    for (let e = el; e; e = e.parentElement) {
      if (e.dataset && e.dataset.bg) return e.dataset.bg;
      if (e instanceof SVGElement) continue;
      const c = getComputedStyle(e).backgroundColor;
      if (c && c !== 'transparent' && !/rgba\\(.*,\\s*0\\)$/.test(c)) return c;
    }
    return 'rgb(255, 255, 255)';
  };
  const out = [];
  for (const el of document.body.querySelectorAll('*')) {
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!own || !visible(el) || el.closest('title')) continue;
    const s = getComputedStyle(el);
    const fg = el instanceof SVGElement ? s.fill : s.color;
    out.push([el.tagName + ' ' + el.textContent.trim().slice(0, 30), fg, background(el)]);
  }
  return out;
}"""


def _luminance(color: str) -> float:
    color = color.strip()
    if color.startswith("#"):
        channels = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    else:
        channels = [int(float(v)) for v in re.findall(r"[\d.]+", color)[:3]]

    def linear(c: int) -> float:
        v = c / 255
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(fg: str, bg: str) -> float:
    a, b = sorted((_luminance(fg), _luminance(bg)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def test_access_basics(page: Any) -> None:
    sec = section(page, "branchy")
    sec.locator("[data-role=summary][data-budget]").wait_for(state="attached")
    section(page, "broken").locator("[data-role=error]").wait_for(state="visible")
    # every control has a name a screen reader reads out
    unnamed = page.evaluate("""() => [...document.querySelectorAll('input, select, button')]
        .filter(e => !e.hidden && !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                     && !e.textContent.trim())
        .map(e => e.outerHTML)""")
    assert unnamed == []
    assert page.get_by_role("slider", name="Memory budget").count() == 2
    assert page.get_by_role("combobox", name="Request size").count() == 2
    assert page.get_by_role("img", name=re.compile("Time per sample against memory")).count() == 2
    # the slider moves with the keyboard alone, and says its value in words
    slider = sec.locator("[data-role=memory]")
    slider.focus()
    page.keyboard.press("Home")
    low = int(slider.input_value())
    page.keyboard.press("ArrowRight")
    assert int(slider.input_value()) == low + int(slider.get_attribute("step"))
    rendered(sec, int(slider.input_value()), 4)
    assert "bytes" in slider.get_attribute("aria-valuetext")
    # every visible text, HTML or SVG, at least 4.5:1 against what it is drawn on (WCAG AA)
    texts = page.evaluate(CONTRAST_JS)
    assert len(texts) > 100
    poor = [(what, fg, bg, round(contrast(fg, bg), 2)) for what, fg, bg in texts
            if contrast(fg, bg) < 4.5]
    assert poor == []
