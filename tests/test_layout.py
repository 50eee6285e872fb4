"""The rooms hold (docs/architecture.md, CONTRIBUTING.md): imports go one way, service ->
workers -> planner -> core; the load generator (loadgen/, a client) imports only core and the
OIP stubs, and only `vbs loadtest`'s dispatch imports it; serving never loads numba or the DP;
no function outside a numba kernel is longer than ``MAX_LINES``. Parsed with ``ast``, so
nothing here imports the code."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("core", "planner", "workers", "service")  # each may import only those before it
LOADGEN = "loadgen"  # a client beside the rooms: core and the OIP stubs only
LOADGEN_MAY_IMPORT = ("core", "service.oip", LOADGEN)
LOADGEN_DISPATCH = ("service/cli.py", "cmd_loadtest")  # the one way into it, when it runs
CHECKED = (*ROOMS, LOADGEN, "bench")
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


def _imports_in(path: Path) -> list[tuple[str, str | None]]:
    """Every absolute import of ``path`` as (dotted module, the function it is made in or None
    at module level); ``from a import b`` counts as ``a.b``."""
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.extend((f"{child.module}.{a.name}", function) for a in child.names)
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), None)
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_imports_go_one_way(room: str) -> None:
    allowed = set(ROOMS[:ROOMS.index(room) + 1]) | {LOADGEN}  # (its own test, below)
    wrong = {str(p.relative_to(ROOT)): sorted(_imported(p) - allowed) for p in _modules(room)}
    assert not {k: v for k, v in wrong.items() if v}, \
        f"{room}/ may import only {sorted(allowed)}: move the code into the lower room it needs"


def test_the_load_generator_imports_only_core_and_the_oip_stubs() -> None:
    """A client: nothing of the server (or of the planner and workers) comes with it."""
    def allowed(module: str) -> bool:
        return any(module == a or module.startswith(a + ".") for a in LOADGEN_MAY_IMPORT)

    ours = set(CHECKED)
    wrong = {f"{p.relative_to(ROOT)}: {module}" for p in _modules(LOADGEN)
             for module, _ in _imports_in(p)
             if module.split(".")[0] in ours and not allowed(module)}
    assert not wrong, f"loadgen/ may import only {list(LOADGEN_MAY_IMPORT)}: {sorted(wrong)}"


def test_only_the_loadtest_command_imports_the_load_generator() -> None:
    """The rooms never import loadgen/ but `vbs loadtest`'s dispatch, inside it (lazily)."""
    wrong = []
    for room in ROOMS:
        for path in _modules(room):
            where = str(path.relative_to(ROOT))
            wrong += [f"{where}: {module} (in {function or 'the module'})"
                      for module, function in _imports_in(path)
                      if module.split(".")[0] == LOADGEN
                      and (where, function) != LOADGEN_DISPATCH]
    assert not wrong, (f"only {LOADGEN_DISPATCH[0]}'s {LOADGEN_DISPATCH[1]} may import "
                       f"{LOADGEN}/: {wrong}")


def test_benchmarks_import_nothing_from_the_tests() -> None:
    """What a benchmark needs lives in bench/ or in the package, never in tests/."""
    wrong = [f"{p.relative_to(ROOT)}: {module}" for p in _modules("bench")
             for module, _ in _imports_in(p) if module.split(".")[0] == "tests"]
    assert not wrong, f"bench/ imports from tests/: {wrong}"


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


MAX_CLASS_LINES = 300  # a class longer than this holds more than one job (issue 56)


def test_no_class_of_the_service_or_the_workers_is_longer_than_the_limit() -> None:
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1})"
            for top in ("service", "workers") for p in _modules(top)
            for n in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"classes over {MAX_CLASS_LINES} lines (give a part its own class): {long}"


def test_a_requests_claims_have_one_owner() -> None:
    """A request's pin and memory ticket are taken and given back only by ``service.claims``
    (HTTP and gRPC alike); memory rules stay with the device's memory owner (workers/)."""
    claims = re.compile(r"residency\.(use|done)\(|memory\.(done|resize|keep)\(|vbs_ticket|vbs_use")
    rules = re.compile(r"\b(RESERVE_SHARE|growth|cpu_free|give_back_arena)\b")
    found = {f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in _modules("service") for i, line in enumerate(p.read_text().splitlines(), 1)
             if (claims.search(line) and p.name != "claims.py") or rules.search(line)}
    assert not found, f"claims or memory rules outside their owners: {sorted(found)}"
    edges = {"serving.py", "grpc_api.py"}
    wrong = {f"{p.name}: {m}" for p in _modules("service") if p.name in edges
             for m, _ in _imports_in(p) if m.startswith("service.admission")}
    assert not wrong, f"the edges reach admission only through service.claims: {sorted(wrong)}"
