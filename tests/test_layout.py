"""The rooms hold (docs/architecture.md, CONTRIBUTING.md): imports go one way, service ->
workers -> planner -> core; serving never loads numba or the DP; no function outside a numba
kernel is longer than ``MAX_LINES``. Parsed with ``ast``, so nothing here imports the code."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("core", "planner", "workers", "service")  # each may import only those before it
CHECKED = (*ROOMS, "bench")
MAX_LINES = 80


def _modules(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py") if "_pb2" not in p.name)


def _imported(path: Path) -> set[str]:
    """The top-level packages of this repository that ``path`` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(CHECKED)


@pytest.mark.parametrize("room", ROOMS)
def test_imports_go_one_way(room: str) -> None:
    allowed = set(ROOMS[:ROOMS.index(room) + 1])
    wrong = {str(p.relative_to(ROOT)): sorted(_imported(p) - allowed) for p in _modules(room)}
    assert not {k: v for k, v in wrong.items() if v}, \
        f"{room}/ may import only {sorted(allowed)}: move the code into the lower room it needs"


def _is_numba_kernel(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("njit", "jit"):
            return True
    return False


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for top in CHECKED:
        for path in _modules(top):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and not _is_numba_kernel(node):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {MAX_LINES} lines (split them into named pieces): {long}"


def test_serving_loads_neither_numba_nor_the_dp() -> None:
    """Importing the app (and building it) reads tables; it must not pay for the solver."""
    code = ("import sys, json; from service.main import create_app; from service.settings import "
            "Settings; create_app(Settings(grpc_port=0)); print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    offline = {"numba", "planner.solver.dp", "planner.solver.kernel", "planner.solver.tables",
               "planner.solver.plain", "planner.solver.solve", "planner.profiling.profiler"}
    assert not loaded & offline, f"serving imported {sorted(loaded & offline)}"
