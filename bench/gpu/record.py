"""What every step of the GPU run shares: its JSON record, its deadline, its subprocesses.

A device call has a hard limit (10 minutes) and returns only what is under $OUT, so a step
writes its record after every item (a call killed at its limit still returns what was done),
copies it to $OUT when the device tool set one, stops starting items its deadline cannot hold
(recorded as skipped, not lost), and runs every command with a timeout inside the deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
VBS = [sys.executable, "-m", "service.commands"]  # `vbs`, with this interpreter


def publish(path: Path, folder: str = "") -> None:
    """Copy ``path`` into the device tool's $OUT (set only on the device machine), or into its
    ``folder`` (one level down: the tool brings back at most 8 files, 2 folders down)."""
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        dest = Path(out) / folder if folder else Path(out)
        dest.mkdir(exist_ok=True)
        shutil.copy2(path, dest / path.name)


def tagged(name: str, tag: str = "") -> str:
    """A record's file name in a call given ``--tag`` (``bench-call2.json``): two calls' records
    copied into one folder do not overwrite each other, and the summary reads them all."""
    stem, dot, ext = name.partition(".")
    return f"{stem}-{tag}{dot}{ext}" if tag else name


@dataclass
class Deadline:
    """Seconds left to a call; ``reserve`` is kept for writing the results."""

    seconds: float
    reserve: float = 20.0
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start) - self.reserve

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


@dataclass
class Ran:
    """A finished command: exit code, seconds, output (stdout and stderr together)."""

    cmd: list[str]
    rc: int
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def tail(self, chars: int = 2000) -> str:
        return self.output[-chars:]


def run(cmd: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
        log: Path | None = None) -> Ran:
    """Run ``cmd`` in the repository root; a timeout is exit code 124, as timeout(1) gives."""
    t0 = time.perf_counter()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        done = subprocess.run(list(cmd), cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=max(1.0, timeout_s))
        rc, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        rc, output = 124, (out.decode() if isinstance(out, bytes) else out) + \
            f"\n[killed after {timeout_s:.0f} s: the step's deadline]"
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
    return Ran(list(cmd), rc, round(time.perf_counter() - t0, 2), output)


class Record:
    """One step's results: items, checks, and the file they are written to."""

    def __init__(self, step: str, out: Path, device: str, quick: bool, tag: str = "") -> None:
        self.tag = tag
        self.path = out / tagged(f"{step}.json", tag)
        self.data: dict[str, Any] = {
            "step": step, "device": device, "quick": quick, "tag": tag,
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": 0.0, "ok": True, "checks": [], "items": [], "skipped": []}
        self._t0 = time.perf_counter()

    def item(self, item: dict[str, Any]) -> None:
        self.data["items"].append(item)
        self.write()

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"what": what, "why": why})
        self.write()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.data["ok"] = self.data["ok"] and bool(ok)
        self.write()
        return ok

    def set(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self._t0, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
        publish(self.path)


def environment() -> dict[str, Any]:
    """The machine a step ran on: Python, torch, the GPU (CUDA, cuDNN, driver), the CPU."""
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(),
                   gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception as exc:  # noqa: BLE001 - a description, not a requirement
            env["driver"] = f"unknown ({exc})"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        env["commit"] = head.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env
