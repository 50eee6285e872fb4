"""The README's two pictures of the page, taken from a real `vbs serve` in chromium.

    .venv/bin/python bench/ui_screenshots.py [--model squeezenet1_0] [--input-shape 3,96,96]
        [--batch-max 8] [--out docs/img]

Starts `vbs serve` (CPU, its own plan store under ``out/ui-shots``, profiles cached there) on a
free loopback port, puts a small closed-loop load on it (``loadgen.loadtest``, 4 clients), opens
``/ui`` in Debian's chromium through Playwright, moves the memory slider with the keyboard to a
budget where the plan splits, and saves ``ui-plan.png`` (the plan: phases per unit, Table III)
and ``ui-live.png`` (Fig. 7 with the budget and the memory free now, and the live figures).
The first run profiles the model (a minute or two on two cores); later runs read the tables.
Needs Playwright (the test extra) and Debian's chromium, both of which `make test` installs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import IO

from served import ROOT, vbs_serve

WORK = ROOT / "out" / "ui-shots"  # its plan store and profiles, kept between runs


def serve_page_model(args: argparse.Namespace, root: Path = ROOT,
                     log: IO[bytes] | int | None = None
                     ) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], str]]:
    """`vbs serve` of ``--model`` at ``--input-shape`` (``--batch-max``) from the checkout
    ``root``, on the tables under ``WORK``: what this script and bench/ui_overhead.py load."""
    env = {**os.environ, "VBS_CACHE_DIR": str(WORK / "cache"), "VBS_STORE": str(WORK / "store"),
           "VBS_BATCH_MAX": str(args.batch_max), "VBS_PROFILE_GRID": "true",
           "VBS_PROFILE_REPEATS": "3"}
    env.pop("VBS_API_KEY", None)
    return vbs_serve(["--model", f"{args.model}@{args.input_shape.replace(',', 'x')}",
                      "--log-level", "warning"], env=env, what=f"vbs serve from {root}",
                     root=root, timeout_s=900, log=log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="squeezenet1_0")
    parser.add_argument("--input-shape", default="3,96,96")
    parser.add_argument("--batch-max", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--steps-up", type=int, default=40,
                        help="arrow presses up from the smallest budget (of the slider's 200)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from loadgen.loadtest import run_loadtest

    WORK.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(WORK / "serve.log", "wb") as log, serve_page_model(args, log=log) as (_, url):
        load = threading.Thread(target=lambda: asyncio.run(run_loadtest(
            url, args.model, clients=4, duration_s=40, samples=2)), daemon=True)
        load.start()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                        args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{url}/ui")
            sec = page.locator(f"section.model[data-model='{args.model}']")
            sec.locator("[data-role=summary][data-budget]").wait_for(state="attached")
            slider = sec.locator("[data-role=memory]")
            slider.focus()
            page.keyboard.press("Home")
            for _ in range(args.steps_up):
                page.keyboard.press("ArrowRight")
            budget = slider.input_value()
            sec.locator(f"[data-role=summary][data-budget='{budget}']").wait_for(state="attached")
            page.wait_for_function("el => Number(el.textContent) > 0",
                                   arg=sec.locator("[data-role=live-served]").element_handle(),
                                   timeout=60_000)
            page.wait_for_timeout(3000)  # a few rounds of live figures under load
            slider.blur()
            plan = args.out / "ui-plan.png"
            top = page.evaluate("el => el.getBoundingClientRect().top + window.scrollY",
                                sec.element_handle())
            box = sec.bounding_box()
            page.screenshot(path=str(plan), full_page=True, clip={
                "x": box["x"], "y": top, "width": box["width"], "height": 900})
            live = args.out / "ui-live.png"
            sec.locator(".grid > div").screenshot(path=str(live))  # Fig. 7 and live
            browser.close()
        print(f"wrote {plan} and {live} ({args.model} {args.input_shape}, budget {budget} bytes)")


if __name__ == "__main__":
    main()
