"""``VBS_ORT_ARENA=none``: what ONNX Runtime allocates inside a call leaves the process when the
call returns (the arena's free regions given back after each call, ``run_options``, and glibc
giving large buffers back at once, ``give_back_freed_memory``), where the shared arena keeps it;
``auto`` under a limit keeps it, and it leaves when the memory owner gives it back between
calls (``give_back_arena``). In a child process each, since the malloc setting is
process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20

CHILD = r"""
import gc, json, sys
import numpy as np
import torch
from core.loaded import ModelSpec
from core.runtimes.ort_memory import status_bytes
from core.runtimes.ort_sessions import give_back_arena, give_back_freed_memory
from core.runtimes.onnxrt import OrtUnits
from planner.graph.capture import capture
from planner.models import load_model

mode = sys.argv[1]
arena = mode != "none"
if mode != "shared":
    give_back_freed_memory()
torch.manual_seed(0)
cap = capture(load_model(ModelSpec("squeezenet1_0", input_shape=(3, 224, 224))))
units = OrtUnits(cap, arena=arena)
whole = tuple(cap.tree.children)
x = cap.model.example(8, seed=1)
units.prepare(whole, 8)  # the session made, nothing run yet
with torch.inference_mode():
    y = units.call(whole, x[:1], 1)  # a first call's own allocations (kernels, plans)
    gc.collect()
    before = status_bytes("VmRSS")
    y = units.call(whole, x, 8)
    del y
    gc.collect()
    if mode == "between":
        kept = status_bytes("VmRSS") - before
        assert give_back_arena()
    after = status_bytes("VmRSS")
if mode == "between":  # what the arena kept until then, the control
    assert kept > 24 * 2**20, kept
print(json.dumps({"kept": after - before, "before": before}))
"""


def _kept(arena: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD, arena], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(json.loads(done.stdout.strip().splitlines()[-1])["kept"])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_without_the_arena_a_call_gives_its_memory_back() -> None:
    # squeezenet1_0 at 224 px, 8 samples: tens of MiB of activations inside the call
    shared, none = _kept("shared"), _kept("none")
    # the control: the arena keeps what the call of 8 samples needed beyond the call of one
    assert shared > 24 * MiB, f"the shared arena kept only {shared / MiB:.1f} MiB"
    assert none < 8 * MiB, f"without the arena the process kept {none / MiB:.1f} MiB"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_what_the_arena_kept_leaves_when_it_is_given_back_between_calls() -> None:
    # the child asserts the arena kept more than 24 MiB after the call, before the give-back
    assert _kept("between") < 8 * MiB
