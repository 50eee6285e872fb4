"""Download the wheels of bench/gpu/wheels.txt for one Python version: `make gpu-wheels`.

    python3 bench/gpu/wheels.py [--python 3.12] [--dest .gpu-wheels] [--max-mib 24] [--check]

The GPU machine reaches no package registry, so what its image lacks travels with each device
call (`carry`, 64 MiB per call with the working tree). This fetches exactly the pinned wheels
into ``DEST/cpXY`` (cp312 for the GPU machine, manylinux x86_64; for this machine's own Python,
its own platform, as the CPU rehearsal installs them here), removes any other wheel there (two
releases of one package stop the whole install), checks that every wheel's own needs are in
wheels.txt or the image's list (bench/gpu/image.txt), and that the folder stays under
``--max-mib``. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# manylinux tags the GPU machine takes (its glibc is newer than all of them); pip matches each
# tag exactly, so the common ones are named (the device tool's README)
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64"]


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> list[str]:
    """The non-comment lines of a list file."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def pins(path: Path = HERE / "wheels.txt") -> dict[str, str]:
    """wheels.txt as {normalized name: version}; every line must be NAME==VERSION."""
    out = {}
    for line in read_list(path):
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise SystemExit(f"{path}: {line!r} is not NAME==VERSION; pin every wheel")
        out[normalize(name)] = version.strip()
    return out


def image() -> set[str]:
    """The distributions the GPU image holds (bench/gpu/image.txt), normalized."""
    return {normalize(n) for n in read_list(HERE / "image.txt")}


def wheel_key(path: Path) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name."""
    parts = path.name[:-len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def folder(dest: Path, python: str) -> Path:
    return dest / ("cp" + python.replace(".", ""))


def _requires(path: Path) -> list[str]:
    """A wheel's Requires-Dist lines."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in head.splitlines()
            if line.startswith("Requires-Dist:")]


def unmet_needs(wheels: list[Path], python: str, have: set[str]) -> list[str]:
    """Each wheel's needs (for Python ``python`` on Linux x86_64, extras left out) that are in
    neither ``have`` nor these wheels."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    # this interpreter's own release where it is the target (the rehearsal), else the minor's
    # first (every need of any patch release counted)
    here = "%d.%d" % sys.version_info[:2]
    full = platform.python_version() if python == here else python + ".0"
    env = {"python_version": python, "python_full_version": full,
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "extra": ""}
    missing = []
    for wheel in wheels:
        for line in _requires(wheel):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if normalize(req.name) not in have:
                missing.append(f"{wheel.name} needs {line}")
    return missing


def download(target: Path, wanted: dict[str, str], python: str) -> None:
    """pip download of the pinned wheels missing from ``target``."""
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--only-binary=:all:", "-d", str(target)]
    if python != here:  # another interpreter: the GPU machine's tags, not this machine's
        cmd += ["--python-version", python, "--implementation", "cp"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
    cmd += [f"{name}=={version}" for name, version in sorted(wanted.items())]
    print("downloading " + ", ".join(f"{n}=={v}" for n, v in sorted(wanted.items())))
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"pip download failed (exit {done.returncode}); its error is above. A "
                         "release pinned in bench/gpu/wheels.txt may have no wheel for Python "
                         f"{python} on manylinux x86_64: pin another")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="3.12",
                        help="the target's Python, MAJOR.MINOR (3.12: the GPU machine's)")
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--max-mib", type=float, default=24.0,
                        help="most the folder may weigh (it travels with every device call)")
    parser.add_argument("--check", action="store_true", help="check the folder, download nothing")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        raise SystemExit(f"--python {args.python!r}: give MAJOR.MINOR, e.g. 3.12")
    wanted = pins()
    target = folder(args.dest, args.python)
    target.mkdir(parents=True, exist_ok=True)
    for stale in sorted(target.glob("*.whl")):  # anything not pinned: one release per package
        name, version = wheel_key(stale)
        if wanted.get(name) != version:
            print(f"removing {stale.name}: not pinned in wheels.txt")
            stale.unlink()
    have = {wheel_key(w)[0] for w in target.glob("*.whl")}
    missing = {n: v for n, v in wanted.items() if n not in have}
    if missing and args.check:
        raise SystemExit(f"{target} lacks {', '.join(sorted(missing))}: run make gpu-wheels")
    if missing:
        download(target, missing, args.python)
    wheels = sorted(target.glob("*.whl"))
    found: dict[str, list[str]] = {}
    for w in wheels:
        found.setdefault(wheel_key(w)[0], []).append(w.name)
    problems = [f"{n}: no wheel" for n in wanted if n not in found]
    problems += [f"{n}: {len(files)} wheels ({', '.join(files)})" for n, files in found.items()
                 if len(files) != 1]
    problems += unmet_needs(wheels, args.python, image() | set(wanted))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.2f} MiB in {target}")
    if total > args.max_mib * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB is over --max-mib {args.max_mib:g}: a device "
                        "call carries 64 MiB with the working tree")
    if problems:
        print("wheels.py: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
