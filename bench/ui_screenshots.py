"""The README's two pictures of the page, taken from a real `vbs serve` in chromium.

    .venv/bin/python bench/ui_screenshots.py [--model squeezenet1_0] [--input-shape 3,96,96]
        [--batch-max 8] [--out docs/img]

Starts `vbs serve` (CPU, its own plan store under ``out/ui-shots``, profiles cached there) on a
free loopback port, puts a small closed-loop load on it (``service.loadtest``, 4 clients), opens
``/ui`` in Debian's chromium through Playwright, moves the memory slider with the keyboard to a
budget where the plan splits, and saves ``ui-plan.png`` (the plan: phases per unit, Table III)
and ``ui-live.png`` (Fig. 7 with the budget and the memory free now, and the live figures).
The first run profiles the model (a minute or two on two cores); later runs read the tables.
Needs Playwright (the test extra) and Debian's chromium, both of which `make test` installs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    from service.loadtest import run_loadtest

    work = ROOT / "out" / "ui-shots"
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VBS_CACHE_DIR": str(work / "cache"), "VBS_STORE": str(work / "store"),
           "VBS_BATCH_MAX": str(args.batch_max), "VBS_PROFILE_GRID": "true",
           "VBS_PROFILE_REPEATS": "3"}
    env.pop("VBS_API_KEY", None)
    log = open(work / "serve.log", "wb")
    module = "service.commands"  # the `vbs` command of this checkout
    process = subprocess.Popen(
        [sys.executable, "-m", module, "serve", "--grpc-port", "0", "--model",
         f"{args.model}@{args.input_shape.replace(',', 'x')}", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"], cwd=ROOT, env=env, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise SystemExit(f"vbs serve exited; see {work / 'serve.log'}")
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("vbs serve not ready in 15 minutes")
            time.sleep(1)
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
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


if __name__ == "__main__":
    main()
