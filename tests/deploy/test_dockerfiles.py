"""docker/Dockerfile.cpu, docker/Dockerfile.cuda and docker/Dockerfile.worker (the CPU worker
without torch), read as Dockerfiles: multi-stage from pinned slim bases, the project installed as
a package, a non-root user, a health check that works; the worker's requirements are
pyproject.toml's dependencies less torch and what serving never imports.

No Docker engine here, so nothing is built: the checks read the files, run the HEALTHCHECK command
itself against a local HTTP server, and check that .dockerignore lets in what the COPYs need
(`make compose-test` builds and runs the images)."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.support import REPO, run_python_check

DOCKERFILES = {flavour: REPO / "docker" / f"Dockerfile.{flavour}"
               for flavour in ("cpu", "cuda", "worker")}
WITH_TORCH = ("cpu", "cuda")  # the worker image has none
TORCH, TORCHVISION = "2.14.1", "0.29.1"
WORKER_REQUIREMENTS = REPO / "docker" / "worker-requirements.txt"
# pyproject.toml's dependencies the worker image leaves out: `vbs serve` on the CPU without
# torch never imports them (numba: the DP's kernels, imported only by `vbs solve` and `vbs plan`)
NOT_IN_WORKER = {"torch", "torchvision", "numba", "matplotlib", "tqdm"}


@dataclass
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM this instruction belongs to (-1: before the first FROM)


def parse(path: Path) -> list[Instruction]:
    """Instructions in order: comments dropped, backslash continuations joined."""
    out: list[Instruction] = []
    stage = -1
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if logical and line.startswith("#"):  # comment lines inside a continuation are skipped
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, args = logical.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage))
        logical = ""
    assert not logical, f"{path}: a continuation runs off the end"
    return out


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)


def stages(instructions: list[Instruction]) -> list[tuple[str, str | None]]:
    """(base image with ARG defaults substituted, stage name) for each FROM."""
    variables = arg_defaults(instructions)
    result = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            result.append((substitute(words[0], variables), name))
    return result


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


@pytest.fixture(params=sorted(DOCKERFILES))
def flavour(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def instructions(flavour: str) -> list[Instruction]:
    return parse(DOCKERFILES[flavour])


# ------------------------------------------------------------------------------- structure
def test_multi_stage_from_pinned_slim_python_311(instructions: list[Instruction]) -> None:
    found = stages(instructions)
    assert len(found) >= 2, "the image must be multi-stage (builder + runtime)"
    for image, _ in found:
        assert "$" not in image, f"unresolved base image {image}"
        assert "@sha256:" in image or re.search(r":[^:/]*\d", image), f"{image}: no pinned tag"
        assert not re.search(r":latest\b", image), f"{image}: latest is not a pin"
        assert "slim" in image, f"{image}: use a slim base"
        assert re.match(r"(docker\.io/library/)?python:3\.11\.\d+-", image), \
            f"{image}: the project's images are Python 3.11 with the patch release pinned"
    names = [name for _, name in found]
    assert "builder" in names
    runtime = final_stage(instructions)
    assert any(i.keyword == "COPY" and "--from=builder" in i.args for i in runtime), \
        "the runtime stage copies the venv from the builder"
    assert not any(i.keyword == "RUN" and re.search(r"\bpip\b.*\binstall\b", i.args)
                   for i in runtime), "no pip install in the runtime stage: it copies the venv"


def test_pulls_nothing_but_its_base_images(flavour: str) -> None:
    """A `# syntax=` directive makes BuildKit pull a frontend image from Docker Hub before the
    build starts: offline builds (compose.offline.yaml, `make compose-test`) cannot."""
    directives = [line for line in DOCKERFILES[flavour].read_text().splitlines()
                  if re.match(r"#\s*syntax\s*=", line, flags=re.IGNORECASE)]
    assert not directives, f"{DOCKERFILES[flavour].name}: {directives[0]}"


def test_runs_as_a_non_root_numeric_user(instructions: list[Instruction]) -> None:
    users = [i.args for i in final_stage(instructions) if i.keyword == "USER"]
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) == 10001, \
        f"USER {users[-1]}: a numeric uid (10001) lets Kubernetes verify runAsNonRoot"
    assert any(i.keyword == "RUN" and "useradd" in i.args and "10001" in i.args
               for i in final_stage(instructions)), "uid 10001 has no passwd entry"


def test_exposes_8000_and_8001_and_serves_by_default(flavour: str,
                                                      instructions: list[Instruction]) -> None:
    runtime = final_stage(instructions)
    exposed = {port for i in runtime if i.keyword == "EXPOSE" for port in i.args.split()}
    assert {"8000", "8001"} <= exposed, "HTTP (8000) and gRPC (8001)"
    cmd = [i for i in runtime if i.keyword == "CMD"]
    assert cmd and exec_form(cmd[-1].args) == ["vbs", "serve"]
    env = " ".join(i.args for i in runtime if i.keyword == "ENV")
    written = ["VBS_CACHE_DIR"]
    if flavour in WITH_TORCH:  # numba's kernel cache and matplotlib's: not in the lean worker
        written += ["NUMBA_CACHE_DIR", "MPLCONFIGDIR"]
    for name in written:
        assert name in env, f"runtime ENV does not set {name} (needed with a read-only root fs)"
    assert "VBS_GRPC_PORT=8001" in env.split()


@pytest.mark.parametrize("flavour", WITH_TORCH)
def test_installs_the_project_as_a_package_with_pinned_torch(flavour: str,
                                                             instructions: list[Instruction]) -> None:
    runs = [substitute(i.args, arg_defaults(instructions))
            for i in instructions if i.keyword == "RUN"]
    text = "\n".join(runs)
    assert f"torch=={TORCH}" in text and f"torchvision=={TORCHVISION}" in text
    assert re.search(r"pip install [^\n]*\s\.(\s|$)", text), "the project is installed with pip install ."
    assert not re.search(r"pip install [^\n]*(-e|--editable)\s", text), "not an editable install"
    cpu_index = "https://download.pytorch.org/whl/cpu"
    if flavour == "cpu":
        assert cpu_index in text, "the CPU image takes torch from the CPU wheel index"
    else:
        assert cpu_index not in text, "the CUDA image must not take the CPU-only torch"


def test_copies_only_what_dockerignore_lets_in(instructions: list[Instruction]) -> None:
    """Every COPY source from the build context exists and is not excluded by .dockerignore."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def excluded(path: str) -> bool:  # .dockerignore semantics: the last matching pattern wins
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.replace("**/", "")):
                verdict = not negate
        return verdict

    sources = []
    for ins in instructions:
        if ins.keyword == "COPY" and "--from=" not in ins.args:
            words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            sources += [w.rstrip("/") for w in words[:-1]]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not excluded(source), f"COPY {source}: excluded by .dockerignore"
    for heavy in (".venv", ".git", "tests", "profiles"):
        assert excluded(heavy), f".dockerignore lets {heavy} into the build context"


# ------------------------------------------------------------------------------- the lean worker
def requirement_lines(path: Path) -> list[str]:
    """A requirements file's entries, comments and blank lines dropped."""
    lines = (line.split(" #", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def pyproject_dependencies() -> dict[str, str]:
    """pyproject.toml's [project] dependencies: normalised name -> the entry as written."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    entries = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {canonicalize_name(Requirement(e).name): e for e in entries}


def test_worker_requirements_are_pyprojects_dependencies_less_torch() -> None:
    """Every line of docker/worker-requirements.txt names a pyproject.toml dependency with the
    same version range (floor included) and marker; every dependency is there but torch,
    torchvision, numba, matplotlib and tqdm, so a new dependency must be decided for the worker too."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    declared = pyproject_dependencies()
    listed: dict[str, Requirement] = {}
    for line in requirement_lines(WORKER_REQUIREMENTS):
        wanted = Requirement(line)
        name = canonicalize_name(wanted.name)
        assert name not in listed, f"{line}: listed twice"
        assert name in declared, f"{line}: not a dependency in pyproject.toml"
        have = Requirement(declared[name])
        assert (wanted.specifier, wanted.marker, wanted.extras) == \
            (have.specifier, have.marker, have.extras), \
            f"{line}: pyproject.toml says {declared[name]!r}"
        listed[name] = wanted
    assert not {"torch", "torchvision"} & set(listed), "the worker image has no torch"
    assert set(listed) == set(declared) - NOT_IN_WORKER, \
        f"missing from the worker: {sorted(set(declared) - NOT_IN_WORKER - set(listed))}; " \
        f"left out: {sorted(set(listed) & NOT_IN_WORKER)}"


def test_the_worker_image_installs_no_torch_and_serves_lean() -> None:
    instructions = parse(DOCKERFILES["worker"])
    runs = "\n".join(i.args for i in instructions if i.keyword == "RUN")
    copies = [shlex.split(i.args) for i in instructions
              if i.keyword == "COPY" and "--from=" not in i.args]
    assert ["docker/worker-requirements.txt", "/tmp/worker-requirements.txt"] in copies
    assert re.search(r"pip install (--requirement|-r) /tmp/worker-requirements.txt", runs)
    assert re.search(r"pip install --no-deps \.(\s|$)", runs), \
        "the project without pyproject's dependencies (they name torch)"
    assert not re.search(r"pip install [^\n]*\s\.(\s|$)", runs.replace("--no-deps .", "")), \
        "a second install of the project would bring torch"
    assert "torch==" not in runs and "--index-url" not in runs
    # the build proves the serving path imports and no dependency brought torch in
    assert 'python -c "import service.main, service.commands"' in runs
    assert "vbs serve --help" in runs
    assert all(f"'{name}'" in runs for name in NOT_IN_WORKER), \
        "the build checks that none of what the worker leaves out came in"
    env = " ".join(i.args for i in final_stage(instructions) if i.keyword == "ENV").split()
    assert "VBS_LEAN=on" in env and "VBS_DEVICE=cpu" in env


# ------------------------------------------------------------------------------- HEALTHCHECK
def healthcheck_argv(instructions: list[Instruction]) -> list[str]:
    checks = [i.args for i in final_stage(instructions) if i.keyword == "HEALTHCHECK"]
    assert checks, "the runtime stage has no HEALTHCHECK"
    options, _, command = checks[-1].partition("CMD")
    assert re.search(r"--start-period=\d+s", options), "give model loading a start period"
    argv = exec_form(command.strip())
    assert argv[0] == "python" and "/v2/health/live" in " ".join(argv) and "urllib" in " ".join(argv)
    return argv


def test_healthcheck_passes_on_live_and_fails_otherwise(instructions: list[Instruction],
                                                        health_server) -> None:
    argv = healthcheck_argv(instructions)
    server, handler = health_server
    port = server.server_address[1]
    assert run_python_check(argv, port) == 0
    handler.status = 503
    assert run_python_check(argv, port) == 1
    server.shutdown()
    server.server_close()
    assert run_python_check(argv, port) == 1, "a closed port must read as unhealthy"
