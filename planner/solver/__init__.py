"""The solver of vbs-serve: per-layer batch sizes within a memory budget (pure Python, numpy, numba).

Modules, one job each:

- ``memory``    byte sizes: parse/format (``30MB``, ``2GiB``) and slot rounding
- ``program``   Step, Program, Plan: frozen data with a JSON form and a stable plan id
- ``model``     a Profile flattened into chains of units with boundary sizes, per objective
- ``simulate``  the executable statement of what a program means under the model of memory
- ``kernel``    the numba DP kernels (paper and vbs recurrences) and plan read-out
- ``dp``        runs the kernels over a tree (branch chains first) and reads plans out
- ``plain``     the same recurrences in plain Python (cross-check, speed reference)
- ``baselines`` the paper's FBS and Greedy-VBS under the same model
- ``solve``     ``solve(profile, r, budget, solver=...)``: one plan, any solver
- ``table``     ``build_table``/``PlanTable``: every (r, budget) from one solve; lookup,
                latency bound, bytes
- ``synthetic`` GoogLeNet-, ResNet-50- and chain-shaped profiles without torch
- ``bench``     times table builds (``python -m planner.solver.bench``)

Names are imported lazily so that ``from planner.solver.memory import parse_bytes`` does not
pay for numba.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "parse_bytes": "memory", "format_bytes": "memory",
    "Step": "program", "Program": "program", "Plan": "program",
    "simulate": "simulate", "Simulation": "simulate",
    "solve": "solve", "SOLVERS": "solve",
    "build_table": "table", "PlanTable": "table",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"planner.solver.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'planner.solver' has no attribute {name!r}")
