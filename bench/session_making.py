"""What making one ONNX Runtime session of a model's whole graph costs the process at its peak,
against the graph's weights (``core.runtimes.ort_sessions.SESSION_GROWTH`` is the bound a
session asks free before it is made).

    .venv/bin/python bench/session_making.py resnet34 [resnet50 ...]

Per model, in a process of its own: the model captured at 3x224x224 (random weights), the
process's peak resident set reset (``/proc/self/clear_refs``), the whole graph's session made
as a served model makes it (``OrtUnits.prepare``), then the growth of the resident set, of its
peak, and what the runtime says it holds.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return (int(fields["VmRSS"].split()[0]) >> 10, int(fields["VmHWM"].split()[0]) >> 10)


def measure(name: str) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    from core.loaded import ModelSpec
    from core.runtimes.onnxrt import OrtUnits, _weight_bytes
    from core.runtimes.ort_memory import reset_peak
    from planner.graph.capture import capture
    from planner.models import load_model

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec(name, input_shape=(3, 224, 224))))
    units = OrtUnits(cap, room=lambda: 1 << 40)
    whole = tuple(cap.tree.children)
    weights = _weight_bytes(units.graphs.compose(whole)) >> 20
    gc.collect()
    reset_peak()
    rss, _ = _status()
    units.prepare(whole, 1)
    after, peak = _status()
    print(f"{name}: weights {weights} MiB; made: resident +{after - rss} MiB, peak "
          f"+{peak - rss} MiB ({(peak - rss) / weights:.2f}x its weights), held "
          f"{units.held_bytes >> 20} MiB", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        measure(sys.argv[2])
    else:
        for model in sys.argv[1:] or ["resnet34"]:
            subprocess.run([sys.executable, __file__, "--one", model], check=True)
