"""Step ``profile``: `vbs profile` of every model and dtype on the device, timed.

Each profile is a `vbs profile --no-cache` of its own (a process of its own: the allocator and
cuDNN start fresh for each), with ``--runtime`` given. The record keeps what the profile says
of itself (units, blocks, the profiler's own seconds, the runtimes it measured) and, from its
figures, the time per sample of a whole pass at b = 1 and at B: how much batching buys on this
device, which is what VBS trades memory for. The profiles travel back as profiles.tar.gz.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.record import VBS, Deadline, Record, publish, run


def pass_time(profile: dict[str, Any], b: int) -> float:
    """Seconds of one pass at batch b: every layer's and every fold's time, as measured."""
    total = 0.0

    def walk(node: dict[str, Any]) -> None:
        nonlocal total
        if node.get("time"):
            total += float(node["time"][b - 1])
        for child in node.get("children", ()) or ():
            walk(child)
        for branch in node.get("branches", ()) or ():
            walk(branch)

    walk(profile["root"])
    return total


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    folder = work / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for item in cfg.profiles:
        if not deadline.allows(item.estimate_s):
            rec.skip(f"profile {item.label}", f"{deadline.left():.0f} s left of the call")
            continue
        path = folder / f"{item.model}-{item.dtype}-b{item.batch_max}-{cfg.runtime_of(item)}.json"
        cmd = [*VBS, "profile", "--model", item.model, *item.shape_arg,
               "--batch-max", str(item.batch_max), "--device", cfg.device, "--dtype", item.dtype,
               "--runtime", cfg.runtime_of(item), "--repeats", str(cfg.profile_repeats), "--no-cache",
               "--quiet", "--out", str(path)]
        ran = run(cmd, timeout_s=deadline.left(), env=cfg.vbs_env(work))
        row: dict[str, Any] = {"label": item.label, "model": item.model, "dtype": item.dtype,
                               "batch_max": item.batch_max, "rc": ran.rc, "wall_s": ran.seconds}
        if ran.ok and path.exists():
            profile = json.loads(path.read_text())
            meta = profile["meta"]
            B = profile["batch_max"]
            row.update(device=meta.get("device"), device_name=meta.get("device_name"),
                       units=meta.get("units"), parallel_blocks=meta.get("parallel_blocks"),
                       input_shape=meta.get("input_shape"), profile_s=meta.get("elapsed_s"),
                       runtime=meta.get("runtime"), runtimes=sorted(meta.get("runtimes") or {}),
                       repeats=meta.get("repeats"), warmup=meta.get("warmup"),
                       per_sample_b1_s=pass_time(profile, 1),
                       per_sample_bmax_s=pass_time(profile, B) / B)
            made.append(path)
        else:
            row["error"] = ran.tail(1500)
        rec.item(row)
        rec.check(f"profile {item.label}", ran.ok and row.get("device") == cfg.device,
                  row.get("error", "")[-300:] or f"device {row.get('device')}")
    if made:
        archive = work.parent / "profiles.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for path in made:
                tar.add(path, arcname=f"profiles/{path.name}")
        publish(archive)
