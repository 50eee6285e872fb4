"""Programs and plans: what the solver hands to the executor, as frozen data with a JSON form.

A Program is a list of steps ``{"unit": NAME, "samples": C}``: run that unit on the next C
samples waiting at its input, in order; a step may name the unit runtime it runs on
(``"runtime": "onnxruntime"``, see ``core.runtimes``), else it runs on the unit's default. A step naming a parallel block opens a phase of C
samples of that block; the steps of its branches follow (``planner.solver.simulate`` is the
one executable statement of what a program means). A Plan is a program with what the solver
claims about it: its cost under the objective, its total time, its peak under the DP's model
of memory, and the executor's exact peak and buffer splits (``core.walk``): what
running it allocates, by which plans are chosen.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidProgramError


@dataclass(frozen=True)
class Step:
    """Run ``unit`` on the next ``samples`` samples waiting at its input (on ``runtime``; ''
    is the unit's default)."""

    unit: str
    samples: int
    runtime: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"unit": self.unit, "samples": self.samples}
        if self.runtime:
            out["runtime"] = self.runtime
        return out


@dataclass(frozen=True)
class Program:
    """The steps of one schedule, in the order they run."""

    steps: tuple[Step, ...]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, int]]) -> "Program":
        """A program from ``(unit, samples)`` pairs."""
        return cls(tuple(Step(str(u), int(c)) for u, c in pairs))

    @property
    def runtimes(self) -> tuple[str, ...]:
        """The runtimes its steps name, each once, in order of first use."""
        return tuple(dict.fromkeys(s.runtime for s in self.steps if s.runtime))

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.steps]

    @classmethod
    def from_json(cls, raw: Any) -> "Program":
        """Parse ``[{"unit": NAME, "samples": C[, "runtime": R]}, ...]``; a malformed step is
        an InvalidProgramError."""
        from core.runtimes import RUNTIMES

        if not isinstance(raw, list):
            raise InvalidProgramError(f"a program must be a JSON list of steps, got {type(raw).__name__}")
        steps = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or not {"unit", "samples"} <= set(item) <= \
                    {"unit", "samples", "runtime"}:
                raise InvalidProgramError(f"step {i}: must be an object with 'unit' and 'samples' "
                                          f"(and optionally 'runtime'), got {item!r}")
            unit, samples, runtime = item["unit"], item["samples"], item.get("runtime", "")
            if not isinstance(unit, str):
                raise InvalidProgramError(f"step {i}: 'unit' must be a unit name, got {unit!r}")
            if isinstance(samples, bool) or not isinstance(samples, int):
                raise InvalidProgramError(f"step {i}: 'samples' must be a whole number, got {samples!r}")
            if runtime and runtime not in RUNTIMES:
                raise InvalidProgramError(f"step {i}: 'runtime' must be one of "
                                          f"{', '.join(RUNTIMES)}, got {runtime!r}")
            steps.append(Step(unit, samples, runtime))
        return cls(tuple(steps))

    @property
    def plan_id(self) -> str:
        """A short hash of the steps alone: the same program has the same id in every version."""
        return program_id((s.unit, s.samples, s.runtime) for s in self.steps)


def program_id(steps: Iterable[tuple[str, int] | tuple[str, int, str]],
               runs: Iterable[tuple[int, int]] = ()) -> str:
    """16 hex digits of SHA-256 over the canonical JSON ``[[unit, samples], ...]`` (compact
    separators, ASCII escapes; a step that names its runtime is ``[unit, samples, runtime]``),
    followed, for a plan with runs, by ``;`` and its runs ``[[first, last], ...]``: anyone can
    recompute it from the plan alone, and the same steps cut into other runs are another plan."""
    names: dict[str, str] = {}
    parts = []
    for step in steps:
        u, c = step[0], step[1]
        name = names.get(u)
        if name is None:
            name = names[u] = json.dumps(u, ensure_ascii=True)
        runtime = step[2] if len(step) > 2 else ""  # type: ignore[misc]
        parts.append(f"[{name},{int(c)},{json.dumps(runtime)}]" if runtime else f"[{name},{int(c)}]")
    text = "[" + ",".join(parts) + "]"
    cuts = [f"[{int(a)},{int(b)}]" for a, b in runs]
    if cuts:
        text += ";[" + ",".join(cuts) + "]"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dispatches(steps: int, runs: Sequence[tuple[int, int]]) -> int:
    """What the executor starts to run a program of ``steps`` steps with ``runs``: one runtime
    call per run, and each step outside a run (a unit on torch, a block's folds)."""
    return len(runs) + steps - sum(last - first + 1 for first, last in runs)


@dataclass(frozen=True)
class Plan:
    """A program and the solver's claims about it for ``batch`` samples in ``budget_bytes``."""

    solver: str
    objective: str
    batch: int
    budget_bytes: int
    slot_bytes: int
    program: Program
    cost: float        # total of the objective (seconds for "time", joules for "energy")
    time_total: float  # total seconds, whatever the objective
    modelled_bytes: int  # exact peak under the DP's model of memory (the simulator's figure)
    peak_bytes: int      # exact bytes the executor allocates running it (the walk's figure)
    splits: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (step, sizes): outputs split at once
    runs: tuple[tuple[int, int], ...] = ()  # (first step, last step): one runtime call each
    # median seconds `vbs plan` measured it to take in the executor (None: not measured)
    time_measured: float | None = None

    @property
    def time_per_sample(self) -> float:
        return self.time_total / self.batch

    @property
    def plan_id(self) -> str:
        return program_id(((s.unit, s.samples, s.runtime) for s in self.program.steps), self.runs)

    @property
    def split_map(self) -> dict[int, list[int]]:
        """The splits as the executor takes them: step -> sizes."""
        return {k: list(sizes) for k, sizes in self.splits}

    @property
    def calls(self) -> int:
        """Runtime calls its runs make (every step on such a runtime is in a run)."""
        return len(self.runs)

    @property
    def dispatches(self) -> int:
        """Runtime calls and steps the executor runs itself (``dispatches``)."""
        return dispatches(len(self.program.steps), self.runs)

    @property
    def run_map(self) -> dict[int, int]:
        """The runs as the executor takes them: first step -> last step."""
        return dict(self.runs)

    def to_json(self) -> dict[str, Any]:
        """The object ``vbs solve --json`` prints for a feasible request."""
        return {"feasible": True, "solver": self.solver, "objective": self.objective,
                "batch": self.batch, "memory_budget": self.budget_bytes,
                "slot_bytes": self.slot_bytes, "time_total": self.time_total,
                "time_per_sample": self.time_per_sample, "cost": self.cost,
                "peak_bytes": self.modelled_bytes, "executor_peak_bytes": self.peak_bytes,
                "plan_id": self.plan_id,
                **({"time_measured": self.time_measured} if self.time_measured is not None
                   else {}),
                "program": self.program.to_json(),
                **({"runs": [list(r) for r in self.runs], "calls": self.calls}
                   if self.runs else {})}
