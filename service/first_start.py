"""A model served at once on its first start, and planned beside it (``VBS_FIRST_START=interim``).

Why: a model the store has no table for used to be profiled and planned before it served
anything, minutes on a small CPU (docs/benchmarks.md, section 12). With ``first_start="interim"`` it is served at once from an interim
table (``planner.interim``: the whole model as one ONNX Runtime call at uniform batch sizes,
each one's memory and time measured, within the memory free as every table), while `vbs plan`
profiles, solves and publishes its tables in a child process. The table watch swaps the
planned table in between batches when it is published (``service.table_watch``), as any table
published to the store: a batch runs the table it started with, so no request is lost and
none runs half on each.

Why a child process and not a thread: it is `vbs plan` itself, the command an operator runs
(the same fingerprint from the same settings, its tables and compiled model published as
`vbs plan` publishes them); it has its own torch and ONNX Runtime threads, where this process
runs every batch on one torch thread (``service.loading``); it traces the model without
stopping batches (``core.gate``); what profiling allocates is given back when it exits; and a
crash in it leaves serving alone. Its settings reach it through its environment (the store's
URL may hold a password, which never goes on a command line). It runs at a lower priority
(``NICE``): batches keep the cores, and the profile measured while requests run is slower and
noisier than a quiet machine's (its plans may be worse than they would be); `vbs plan
--replan` on a quiet machine measures it again, and the service swaps that table in too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import StoreError
from core.spec import ModelSpec
from planner.settings import Settings as PlannerSettings
from service.entry import ModelEntry
from service.settings import Settings

log = logging.getLogger("vbs.service")

NICE = 10        # added to this process's niceness for the planner
TAIL = 20        # lines of the planner's output kept for /models and the error
STOP_S = 5.0     # how long a planner has to exit after SIGTERM at shutdown, before SIGKILL
PLANNING, PUBLISHED, FAILED, STOPPED = "planning", "published", "failed", "stopped"
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")  # `vbs`'s log line's time


@dataclass
class Planning:
    """One model's `vbs plan` beside serving it: what it runs and what became of it."""

    model: str
    command: tuple[str, ...]
    state: str = PLANNING
    started: float = field(default_factory=time.time)
    ended: float | None = None
    pid: int | None = None
    error: str | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL))

    def finish(self, state: str, error: str | None = None) -> None:
        self.state, self.error, self.ended = state, error, time.time()

    def describe(self) -> dict[str, Any]:
        """As /models shows it: state (planning, published, failed, stopped), when it started
        (unix seconds), for how long it ran, its pid, and why it failed."""
        out: dict[str, Any] = {"state": self.state, "started_at": round(self.started, 3),
                               "elapsed_s": round((self.ended or time.time()) - self.started, 1),
                               "pid": self.pid}
        if self.error:
            out["error"] = self.error
        return out


def interim_prepared(name: str, model: Any, settings: Settings, options: Any
                     ) -> tuple[Any, dict[str, Any]] | None:
    """``model`` (a ``planner.pipeline.Captured``) with an interim table, as
    ``planner.pipeline.Prepared``, and the runtimes it was measured on (the worker serves with
    them); None, logged with the reason, where there can be none (then it is planned first).
    On the model's torch thread."""
    from core.table import INTERIM
    from planner.interim import build
    from planner.pipeline import Prepared

    if settings.runtime not in ("auto", "onnxruntime"):
        why = f"VBS_RUNTIME={settings.runtime} (the interim table runs ONNX Runtime)"
    else:
        built = build(model.capture, model.fingerprint, model.options.batch_max, options)
        if not isinstance(built, str):
            table = built.table
            log.info("%s: no table in the store yet: serving from an interim table (the whole "
                     "model in ONNX Runtime at batch sizes %s, measured in %.1f s: %d plans) "
                     "while `vbs plan` plans it beside", name, sorted(built.seconds),
                     built.build_s, len(table.plans))
            prepared = Prepared(model.capture, built.profile, {INTERIM: table}, INTERIM,
                                published=False)
            return prepared, {built.units.name: built.units}
        why = built
    log.warning("%s: no interim table (%s): profiling and planning it before it serves", name,
                why)
    return None


def plan_entry(served: str, spec: ModelSpec) -> str:
    """The model as `vbs plan --model` takes it: ``served=name[@shape]``."""
    shape = "@" + ",".join(map(str, spec.input_shape)) if spec.input_shape else ""
    return f"{served}={spec.name}{shape}"


def planner_env(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the `vbs plan` that plans what this service serves: this process's,
    with every planner setting as this service has it (its flags included), so both compute
    the same fingerprint and it publishes where this service reads."""
    env = dict(environ)
    for name in PlannerSettings.model_fields:
        if name == "models":
            continue  # one model, on its command line
        value = settings.store_location if name == "store" else getattr(settings, name)
        key = f"VBS_{name.upper()}"
        if value is None:
            env.pop(key, None)
        elif isinstance(value, bool):
            env[key] = "true" if value else "false"
        else:
            env[key] = str(value) if isinstance(value, (str, int, float, Path)) else repr(value)
    return env


def plan_command(served: str, spec: ModelSpec) -> tuple[str, ...]:
    """`vbs plan` for one served model, run by this Python (its settings in its environment)."""
    return (sys.executable, "-m", "service.commands", "--verbose", "plan", "--model",
            plan_entry(served, spec), "--quiet")


class BackgroundPlans:
    """The `vbs plan` children of the models served from interim tables, one per model;
    ``table_version(table_id)`` reads the store (in a thread) once one has exited."""

    def __init__(self, settings: Settings, table_version: Callable[[str], int | None]) -> None:
        self.settings = settings
        self._table_version = table_version
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._closing = False

    def start(self, entry: ModelEntry) -> None:
        """Plan ``entry`` beside serving it, unless its planning is under way or over (a
        model loaded again while it runs, or after it failed, is not planned twice)."""
        if entry.name in self._tasks:
            return
        planning = Planning(entry.name, plan_command(entry.name, entry.spec))
        entry.planning = planning
        self._tasks[entry.name] = asyncio.create_task(self._run(entry, planning),
                                                      name=f"vbs-plan-{entry.name}")

    async def _run(self, entry: ModelEntry, planning: Planning) -> None:
        try:
            code = await self._child(entry.name, planning)
        except asyncio.CancelledError:
            planning.finish(STOPPED, "the service stopped before planning ended")
            raise
        except OSError as exc:
            planning.finish(FAILED, f"`vbs plan` could not start: {exc}")
            log.error("%s: %s", entry.name, planning.error)
            return
        try:  # what it left in the store, whatever its exit: its table is what counts
            version = await asyncio.to_thread(self._table_version, entry.table_id or "")
        except StoreError as exc:
            log.warning("%s: cannot read the store now: %s", entry.name, exc)
            version = 0 if code == 0 else None  # published, as it says; the watch reads it
        if version is not None:
            planning.finish(PUBLISHED)
            log.info("%s: planned in %.0f s; table %s published, swapped in between batches%s",
                     entry.name, (planning.ended or time.time()) - planning.started,
                     entry.table_id, "" if code == 0 else f" (`vbs plan` then ended with {code})")
        elif self._closing:
            planning.finish(STOPPED, "the service stopped before planning ended")
        elif code != 0:
            last = planning.tail[-1] if planning.tail else "no output"
            planning.finish(FAILED, f"`vbs plan` exited with code {code}: {last}; the interim "
                                    "table goes on serving; run `vbs "
                                    f"{' '.join(planning.command[4:7])}` to see why")
            log.error("%s: %s", entry.name, planning.error)
        else:
            planning.finish(FAILED, f"`vbs plan` published no table {entry.table_id}, the one "
                                    "this service serves: it planned with other settings (another "
                                    "fingerprint); the interim table goes on serving")
            log.error("%s: %s", entry.name, planning.error)

    async def _child(self, name: str, planning: Planning) -> int:
        """Run the planner, its output in this log (and its last lines kept); its exit code.
        In a session of its own: a terminal's Ctrl-C stops the service, which stops it."""
        process = await asyncio.create_subprocess_exec(
            *planning.command, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=planner_env(self.settings, os.environ), start_new_session=True)
        self._processes[name] = process
        planning.pid = process.pid
        _lower_priority(process.pid)
        log.info("%s: `vbs plan` profiles and plans it beside serving (pid %d, niceness +%d: "
                 "measured while requests run, its profile is slower and noisier than a quiet "
                 "machine's)", name, process.pid, NICE)
        assert process.stdout is not None
        async for raw in process.stdout:
            line = _STAMP.sub("", raw.decode(errors="replace").rstrip())  # this log stamps it
            if line:
                planning.tail.append(line)
                log.info("%s: vbs plan: %s", name, line)
        return await process.wait()

    async def close(self) -> None:
        """Stop every planner still running (SIGTERM, then SIGKILL after ``STOP_S``)."""
        self._closing = True
        for name, process in list(self._processes.items()):
            if process.returncode is not None:
                continue
            log.info("%s: stopping `vbs plan` (pid %d): the service is stopping", name,
                     process.pid)
            try:
                process.terminate()
                await asyncio.wait_for(process.wait(), STOP_S)
            except ProcessLookupError:
                pass
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


def _lower_priority(pid: int) -> None:
    """The planner ``NICE`` below this process (batches keep the cores); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE))
    except OSError as exc:
        log.debug("cannot lower the planner's priority: %s", exc)
