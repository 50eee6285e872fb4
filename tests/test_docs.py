"""The operator docs cover what the code defines: every setting, endpoint and metric.

Light: reads Settings' fields, builds the app's OpenAPI document (no lifespan, no model, no
server) and parses service/metrics.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from service.settings import Settings
from service.main import create_app

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
OPERATIONS = ROOT / "docs" / "operations.md"
METRICS_SOURCE = ROOT / "service" / "metrics.py"
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def _text(path: Path) -> str:
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return path.read_text(encoding="utf-8")


def _has_token(text: str, token: str) -> bool:
    """``token`` appears as a whole name (VBS_STORE does not count inside VBS_STORE_POLL_S)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(token)}(?![A-Za-z0-9_])", text) is not None


def _env_names() -> list[str]:
    return [f"VBS_{name.upper()}" for name in Settings.model_fields]


def _operations() -> list[tuple[str, str]]:
    paths = create_app(Settings()).openapi()["paths"]
    return [(method.upper(), path) for path, item in paths.items() for method in item]


def _headings(text: str) -> list[str]:
    return [line[3:] for line in text.splitlines() if line.startswith("## ")]


def _metric_names() -> list[str]:
    """The name (first argument) of every Counter, Gauge, Histogram made in service/metrics.py."""
    names = []
    for node in ast.walk(ast.parse(_text(METRICS_SOURCE))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in METRIC_TYPES and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    return names


@pytest.mark.parametrize("env", _env_names())
def test_every_setting_is_in_operations(env: str) -> None:
    assert _has_token(_text(OPERATIONS), env), f"docs/operations.md does not mention {env}"


def test_operations_names_no_unknown_setting() -> None:
    known = set(_env_names())
    mentioned = set(re.findall(r"VBS_[A-Z0-9_]*[A-Z0-9]", _text(OPERATIONS)))
    unknown = sorted(mentioned - known)
    assert not unknown, f"docs/operations.md names settings that do not exist: {unknown}"


def test_every_endpoint_has_a_section_in_api() -> None:
    headings = _headings(_text(API))
    documented = {item.strip() for h in headings for item in h.split(",")}
    missing = [f"{m} {p}" for m, p in _operations() if f"{m} {p}" not in documented]
    assert not missing, f"docs/api.md has no '## METHOD PATH' section for {missing}"


def test_api_sections_name_real_endpoints() -> None:
    real = set(_operations())
    documented = {(m, p) for h in _headings(_text(API))
                  for m, p in re.findall(r"\b(GET|POST|PUT|DELETE|PATCH) (/[^\s,]*)", h)}
    extra = sorted(documented - real)
    assert not extra, f"docs/api.md documents endpoints the app lacks: {extra}"


def test_every_metric_is_in_operations() -> None:
    names = _metric_names()
    assert len(names) >= 10, f"found only {names} in service/metrics.py"
    text = _text(OPERATIONS)
    missing = [n for n in names if not _has_token(text, n)]
    assert not missing, f"docs/operations.md does not mention the metrics {missing}"


def test_every_benchmark_names_a_command_in_the_repo() -> None:
    """Each section of docs/benchmarks.md names the script or module that regenerates its
    tables, and every script and module it names exists."""
    text = _text(ROOT / "docs" / "benchmarks.md")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        scripts = re.findall(r"\b(bench/[\w./-]+\.(?:py|sh))", section)
        modules = re.findall(r"python -m ([\w.]+)", section)
        assert scripts or modules or "vbs " in section, f"section {title!r} names no command"
        for script in scripts:
            assert (ROOT / script).is_file(), f"{title}: {script} is not in the repo"
        for module in modules:
            path = ROOT / Path(*module.split("."))
            assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), \
                f"{title}: python -m {module} names no module of the repo"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_benchmark_headings_carry_no_date_or_pass() -> None:
    """docs/benchmarks.md holds current results by question; history is in git."""
    headings = re.findall(r"^#+ (.*)$", _text(ROOT / "docs" / "benchmarks.md"), flags=re.M)
    dated = [h for h in headings if re.search(r"\d{4}-\d{2}-\d{2}|\bpass\b", h, flags=re.I)]
    assert headings and not dated, f"headings with a date or a pass: {dated}"


MAX_ANSWER = 200


def test_the_readme_glance_links_to_sections_that_exist() -> None:
    readme = _text(ROOT / "README.md")
    glance = readme.split("## Performance at a glance", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"docs/benchmarks\.md#([\w-]+)", glance)
    assert anchors, "the README's glance links to no section of docs/benchmarks.md"
    headings = re.findall(r"^#+ (.*)$", _text(ROOT / "docs" / "benchmarks.md"), flags=re.M)
    slugs = {_slug(h) for h in headings}
    missing = sorted(set(anchors) - slugs)
    assert not missing, f"the README's glance links to sections that do not exist: {missing}"


def test_the_readme_glance_is_one_short_line_per_question() -> None:
    """Each question of the README's glance is answered in one short cell: the latest figure,
    the details in the section it links to."""
    readme = _text(ROOT / "README.md")
    glance = readme.split("## Performance at a glance", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in glance.splitlines() if r.startswith("| ") and not r.startswith("| question")]
    cells = [[c.strip() for c in r.strip("|").split(" | ")] for r in rows]
    assert len(cells) >= 8, "the glance answers too few questions"
    long = [c[0] for c in cells if len(c) != 3 or len(c[1]) > MAX_ANSWER]
    assert not long, f"answers over {MAX_ANSWER} characters (details go in docs/benchmarks.md): {long}"


def test_no_file_points_outside_the_repository() -> None:
    """A clone holds everything its files refer to: no parent's shared folder, no absolute
    path of a development machine."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    outside = re.compile("|".join(re.escape(s) for s in ("../" + "shared", "/" + "work/",
                                                         "DESIGN" + ".md")))
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".json", ".csv") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}: {m.group(0)}" for m in outside.finditer(text)]
    assert not found, f"paths outside the repository: {found}"
