"""Install vbs-serve for the GPU run, as the GPU machine allows: no registry, its own Python.

On the GPU machine (``--device cuda``) the machine's Python (``python3``, which holds torch) gets
the carried wheels (``.gpu-wheels/cp312``: what its image lacks, bench/gpu/wheels.txt) and then
the project itself, editable, with ``--no-deps --no-build-isolation --no-index``: the build
compiles service/oip/*.proto with the grpcio-tools just installed (setup.py). On the CPU
(``--device cpu``, the rehearsal) the same happens in a fresh venv whose "image" is exactly the
packages of .venv that the GPU image holds (bench/gpu/image.txt), linked in through a .pth file
after the venv's own site-packages, so a wheel the GPU machine would miss is missed here too.
Then bench/gpu/check_install.py, with the installed Python, checks every requirement and
import. Standard library only: nothing of the project is importable before this runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PIP = ["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
       "--no-deps", "--no-cache-dir"]

# Run by .venv's Python: every top-level entry of site-packages that belongs to one of the
# distributions named on stdin (normalized names) or to what they need in turn (the image is
# self-consistent: what its packages need is there, at whatever release .venv's need), as
# absolute paths.
_IMAGE_FILES = r"""
import importlib.metadata as md, json, re, sys
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n or "").lower()
dists = {norm(d.metadata["Name"]): d for d in md.distributions()}
todo, seen = list(json.load(sys.stdin)), set()
while todo:
    name = norm(todo.pop())
    if name in seen or name not in dists:
        continue
    seen.add(name)
    for line in dists[name].requires or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
out = set()
for name in seen:
    for f in dists[name].files or ():
        top = f.parts[0]
        if top not in ("..", "__pycache__"):
            out.add(str(dists[name].locate_file(top)))
print(json.dumps(sorted(out)))
"""


class InstallError(Exception):
    """A step of the install failed; the message says which and what to do."""


def _run(cmd: list[str], what: str, cwd: Path = ROOT) -> None:
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0:
        raise InstallError(f"{what} failed (exit {done.returncode}): {done.stdout[-3000:]}")


def python_tag(python: str) -> str:
    """``cp312`` for the interpreter at ``python``."""
    out = subprocess.run([python, "-c", "import sys; print(f'cp{sys.version_info[0]}"
                                        "{sys.version_info[1]}')"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def shown(folder: Path) -> Path:
    """``folder`` as the repository names it (records and messages hold no machine's paths)."""
    return folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder


def wheels_of(folder: Path) -> list[str]:
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        raise InstallError(f"no wheels in {folder}: run `make gpu-wheels` here (for the CPU "
                           f"rehearsal `make gpu-wheels GPU_PY_VERSION=3.11`) and carry "
                           f"{shown(folder)}")
    return wheels


def fresh_venv(venv: Path, image_python: Path) -> str:
    """A new venv at ``venv`` whose only packages besides pip are .venv's image packages."""
    from wheels import image  # bench/gpu/wheels.py, beside this file

    if not image_python.exists():
        raise InstallError(f"{image_python} is missing: run `make setup` first (the rehearsal "
                           "takes the GPU image's packages from .venv)")
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)], f"creating the venv {venv}")
    python = venv / "bin" / "python"
    found = subprocess.run([str(image_python), "-c", _IMAGE_FILES], input=json.dumps(sorted(image())),
                           capture_output=True, text=True, check=True)
    layer = venv / "gpu-image"
    layer.mkdir()
    for path in json.loads(found.stdout):
        (layer / Path(path).name).symlink_to(path)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # after the venv's own site-packages: the carried wheels win, as on the GPU machine
    Path(purelib, "zz-gpu-image.pth").write_text(f"{layer}\n")
    return str(python)


def install(device: str, wheels_dir: Path | None, venv: Path, image_python: Path) -> dict:
    """Install as ``device``'s machine allows; returns what was done and the check's report."""
    started = time.perf_counter()
    timings = {}
    if device == "cpu":
        python = fresh_venv(venv, image_python)
        timings["venv_s"] = round(time.perf_counter() - started, 2)
    else:
        python = sys.executable
    tag = python_tag(python)
    folder = wheels_dir or ROOT / ".gpu-wheels" / tag
    wheels = wheels_of(folder)
    t0 = time.perf_counter()
    _run([python, *PIP, *wheels], f"installing the wheels of {folder}")
    timings["wheels_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    _run([python, *PIP, "--no-build-isolation", "-e", str(ROOT)],
         "installing vbs-serve (editable, no build isolation; the build compiles the .proto "
         "with grpcio-tools from the wheels)")
    timings["project_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    check = subprocess.run([python, str(HERE / "check_install.py")], cwd=ROOT,
                           capture_output=True, text=True)
    timings["check_s"] = round(time.perf_counter() - t0, 2)
    try:
        report = json.loads(check.stdout)
    except json.JSONDecodeError:
        raise InstallError(f"check_install.py failed (exit {check.returncode}): "
                           f"{(check.stdout + check.stderr)[-3000:]}") from None
    return {"python": python, "python_tag": tag, "fresh_venv": device == "cpu",
            "wheels_dir": str(shown(folder)), "wheels": [Path(w).name for w in wheels],
            "wheels_mib": round(sum(Path(w).stat().st_size for w in wheels) / 2**20, 2),
            "timings": timings, "elapsed_s": round(time.perf_counter() - started, 2),
            **report}


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--wheels", type=Path, help="the wheel folder (default .gpu-wheels/cpXY)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu")
    parser.add_argument("--image-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    args = parser.parse_args()
    try:
        report = install(args.device, args.wheels, args.venv, args.image_python)
    except InstallError as exc:
        print(f"install: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.chdir(ROOT)
    sys.exit(main())
