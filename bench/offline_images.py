"""What an offline build of the images substitutes for the registries it cannot reach, for
compose.offline.yaml (`make compose-test` builds with it; so can anyone without Docker Hub):

- the base image of every vbs-serve image (the planner's docker/Dockerfile.cpu, the lean
  worker's docker/Dockerfile.worker) and of Redis: python:3.11-slim cannot be pulled, so a
  Debian bookworm root made by debootstrap (Debian's Python 3.11 with venv and ca-certificates,
  plus this machine's CA bundle: package downloads go through this machine's TLS setup) is
  imported with `docker import`;
- torch's wheels, for the planner's image only (the worker's has no torch and installs its
  dependencies from the package index, as a build from the registries does): the CPU wheel
  index that docker/Dockerfile.cpu names is not reachable, so the torch and torchvision it
  pins are downloaded by this machine's pip (its own configuration: the wheels on this disk
  first, then PyPI), with their dependencies, into a wheelhouse laid out as a PEP 503 index
  and served on 127.0.0.1 while the image builds. Here that is PyPI's torch,
  the CUDA build with its nvidia-* wheels: no CPU build of this torchvision exists here, and
  PyPI's torchvision (a CUDA build) does not import beside a CPU torch.

    python -m bench.offline_images [--state out/compose] [--port 8765]
      # makes both if missing, then serves the index until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from bench.docker_engine import Engine, find_or_start, wait_for_signal

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "vbs-offline/debian-python:bookworm"  # the default of compose.offline.yaml
SUITE, PYTHON_VERSION, GLIBC_MINOR = "bookworm", "3.11", 36  # Debian 12: Python 3.11, glibc 2.36
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
MIRROR = "http://deb.debian.org/debian"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# what the official Debian-based images set that `docker import` leaves unset
IMAGE_CONFIG = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV LANG=C.UTF-8", 'CMD ["python3"]')
DEBOOTSTRAP_TIMEOUT_S = 1200
PIP_TIMEOUT_S = 1800


def missing_tools() -> str | None:
    """Why the base image cannot be made here, or None."""
    if shutil.which("debootstrap") is None:
        return "debootstrap is not installed: apt-get install -y debootstrap (make compose-test does)"
    if os.geteuid() != 0:
        return "debootstrap needs root"
    return None


def dockerfile_pins(dockerfile: Path = REPO / "docker" / "Dockerfile.cpu") -> dict[str, str]:
    """The ARG defaults of the Dockerfile (TORCH_VERSION, TORCHVISION_VERSION, ...): the pins
    live there, not here."""
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), flags=re.M))


def run_logged(argv: list[str], log: Path, timeout_s: float) -> None:
    """Run ``argv`` with its output in ``log``; RuntimeError quoting the log's end if it fails."""
    with open(log, "wb") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({done.returncode}); its log "
                           f"({log}) ends:\n" + log.read_text(errors="replace")[-3000:])


def image_exists(engine: Engine, name: str) -> bool:
    return engine.docker("image", "inspect", name, check=False).returncode == 0


def _slim(root: Path) -> None:
    """Drop what a container never reads (package caches and lists, manuals, translations,
    documentation but its copyright files), as Debian's slim images do."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*",
                    "usr/share/man/*", "usr/share/locale/*", "usr/share/info/*"):
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for path in (root / "usr/share/doc").rglob("*"):
        if path.is_file() and path.name != "copyright":
            path.unlink()


def make_base_image(engine: Engine, state: Path, name: str = BASE_IMAGE,
                    mirror: str = MIRROR) -> str:
    """``name`` in the engine, made by debootstrap + `docker import` unless it is there already."""
    if image_exists(engine, name):
        return name
    why = missing_tools()
    if why:
        raise RuntimeError(f"cannot make the base image {name}: {why}")
    root = state / "rootfs"
    if root.exists():
        shutil.rmtree(root)
    run_logged(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                str(root), mirror], state / "debootstrap.log", DEBOOTSTRAP_TIMEOUT_S)
    _slim(root)
    shutil.copyfile(CA_BUNDLE, root / CA_BUNDLE.relative_to("/"))
    changes = [arg for change in IMAGE_CONFIG for arg in ("--change", change)]
    with subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."],
                          stdout=subprocess.PIPE) as tar:
        done = subprocess.run(["docker", "import", *changes, "-", name], stdin=tar.stdout,
                              env=engine.env(), capture_output=True, text=True, timeout=600)
    if tar.returncode != 0 or done.returncode != 0:
        raise RuntimeError(f"docker import of {root} as {name} failed: {done.stderr}")
    shutil.rmtree(root)
    return name


def _project(wheel: str) -> str:
    """The PEP 503 normalised project name of a wheel file name."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def make_torch_index(state: Path) -> Path:
    """A PEP 503 index (a directory per project) of the Dockerfile's torch and torchvision and
    their dependencies, for Debian bookworm's Python; downloaded once, reused after."""
    index = state / "torch-index"
    if (index / "torch").is_dir() and (index / "torchvision").is_dir():
        return index
    pins = dockerfile_pins()
    wheels = state / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # every wheel tag bookworm's glibc runs (pip does not widen one --platform to older ones)
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    run_logged(
        [sys.executable, "-m", "pip", "download", "--dest", str(wheels), "--only-binary=:all:",
         "--python-version", PYTHON_VERSION, "--implementation", "cp",
         *[arg for platform in platforms for arg in ("--platform", platform)],
         f"torch=={pins['TORCH_VERSION']}", f"torchvision=={pins['TORCHVISION_VERSION']}"],
        state / "pip-download.log", PIP_TIMEOUT_S)
    partial = state / "torch-index.partial"
    if partial.exists():
        shutil.rmtree(partial)
    for wheel in wheels.glob("*.whl"):
        folder = partial / _project(wheel.name)
        folder.mkdir(parents=True, exist_ok=True)
        os.link(wheel, folder / wheel.name)
    partial.rename(index)
    return index


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_index(index: Path, port: int = 0) -> Iterator[str]:
    """Serve ``index`` on 127.0.0.1 (``port``, 0 = any free) while the block runs; yields its
    URL. A directory listing is a valid PEP 503 project page, so pip reads it as an index."""
    handler = functools.partial(_QuietHandler, directory=str(index))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path("out/compose"),
                        help="where the wheelhouse (and a started engine's files) are kept")
    parser.add_argument("--port", type=int, default=8765, help="port of the index on 127.0.0.1")
    args = parser.parse_args()
    state = args.state.resolve()
    engine = find_or_start(state)
    base = make_base_image(engine, state)
    index = make_torch_index(state)
    with serve_index(index, args.port) as url:
        print(f"export DOCKER_HOST={engine.host} VBS_OFFLINE_BASE_IMAGE={base} "
              f"VBS_OFFLINE_TORCH_INDEX_URL={url}\n"
              "then: docker compose -f compose.yaml -f compose.offline.yaml up --build "
              "(Ctrl-C here stops the index" + (" and the engine)" if engine.process else ")"),
              flush=True)
        wait_for_signal()
    engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
