"""Step ``smoke``: CUDA graphs captured in the bench's and the profiler's orders on a small model
(bench/gpu/smoke.py, a process of its own), first in its call: when it fails, no other step
runs (``python -m bench.gpu`` stops there), so a broken capture costs a minute, not the call.
On the CPU it builds the model and skips at its CUDA call (``CUDA only:``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.record import Deadline, Record, run
from bench.gpu.smoke import CUDA_ONLY


def _result(output: str) -> dict[str, Any] | None:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def main(cfg: Config, work: Path, rec: Record, deadline: Deadline) -> None:
    s = cfg.smoke
    if not deadline.allows(s.estimate_s):
        rec.skip("smoke", f"{deadline.left():.0f} s left of the call")
        rec.check("smoke: ran", False, "the deadline left no time for it")
        return
    cmd = [sys.executable, "-m", "bench.gpu.smoke", "--device", cfg.device, "--model", s.model,
           "--shape", ",".join(map(str, s.shape))]
    ran = run(cmd, timeout_s=min(s.timeout_s, deadline.left()), env=cfg.vbs_env(work),
              log=work / "smoke.log")
    result = _result(ran.output) or {"ok": False, "stages": [], "skipped": ""}
    rec.item({"what": " ".join(cmd[1:]), "rc": ran.rc, "wall_s": ran.seconds, **result,
              **({} if ran.ok else {"error": ran.tail(1500)})})
    if result.get("skipped"):
        rec.skip("smoke: graph capture", result["skipped"])
        rec.check("smoke: skipped only at its CUDA call", cfg.device != "cuda"
                  and result["skipped"].startswith(CUDA_ONLY), result["skipped"])
        return
    bad = [f"{st['name']}: {st['error']}" for st in result.get("stages", []) if not st["ok"]]
    rec.check("smoke: graphs captured and replayed model(x) in every order",
              ran.ok and bool(result.get("ok")), "; ".join(bad)[-600:] or ran.tail(600))
