"""float16 as a model's precision where it pays: on CUDA (issue 59). The digits CNN (trained for
a few seconds on scikit-learn's digits) planned with `--precision float16` on the device, its
plans run by the worker against the half model's own answer; then `auto`, timed on the device
for real, weighing float32 against every half precision CUDA has kernels of.

On the CPU float16 is emulated: the plan and the served answer run here too (the same path, in
`make test`), `auto`'s CUDA timing is the part that skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.loaded import ModelSpec
from core.precision import FLOAT16, HALF_TOLERANCE, Precision
from planner.graph.capture import capture
from planner.models import load_model
from planner.precision import with_precision
from planner.precision_half import natives
from planner.precision_speed import FOLDER, MIN_SPEEDUP
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from tests.gpu.conftest import cuda_only
from workers.memory import MemoryProbe
from workers.worker import Worker

pytest.importorskip("sklearn")  # the test extra: scikit-learn's bundled digits
from tests.planner.digits import SHAPE, digits, factory, train  # noqa: E402

pytestmark = pytest.mark.gpu
NAME = "tests.planner.digits:factory"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray]:
    """(weights, calibration folder, test inputs) of the digits CNN."""
    root = tmp_path_factory.mktemp("digits-half")
    x, y = digits()
    torch.save(train(x[:600], y[:600], epochs=3).state_dict(), root / "w.pt")
    folder = root / "calibration"
    folder.mkdir()
    np.save(folder / "samples.npy", x[600:664])
    return root / "w.pt", folder, x[700:716]


def test_float16_planned_on_the_device_answers_as_the_half_model(
        device: str, tmp_path: Path, trained: tuple[Path, Path, np.ndarray]) -> None:
    weights, folder, x = trained
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=weights, device=device)))
    half = with_precision(cap, FLOAT16, folder, 0.5, tmp_path / "cache")
    assert half.precision.name == FLOAT16 and half.model.torch_dtype == torch.float16
    assert half.model.device.type == device and half.precision.held_out == 16
    profile = measure(half, ProfileOptions(batch_max=4, repeats=1, warmup=1), progress=False)
    table = build_table(profile, slot_count=48)
    worker = Worker(half, table, MemoryProbe(device), name="half")
    try:
        got = np.concatenate([
            worker.infer(worker.model.to_input(torch.from_numpy(c)))[0].float().cpu().numpy()
            for c in np.array_split(x, 4)])
    finally:
        worker.release()
    with torch.inference_mode():
        model = factory()
        model.load_state_dict(torch.load(weights, weights_only=True))
        model = model.eval().to(device=device, dtype=torch.float16)
        own = model(torch.from_numpy(x).to(device=device, dtype=torch.float16)).float().cpu()
    scale = max(1.0, float(own.abs().max()))
    assert float(np.abs(got - own.numpy()).max()) <= HALF_TOLERANCE * scale
    assert (got.argmax(1) == own.numpy().argmax(1)).all()


def test_auto_on_cuda_weighs_float16_against_float32_as_measured(
        device: str, tmp_path: Path, trained: tuple[Path, Path, np.ndarray]) -> None:
    weights, folder, _ = trained
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=weights, device=device)))
    cuda_only(device, "auto times torch's float32 and half-precision kernels on CUDA")
    halves = natives(cap.model.device)
    assert FLOAT16 in halves
    cache = tmp_path / "cache"
    chosen: Precision = with_precision(cap, "auto", folder, 0.5, cache).precision
    (times,) = [json.loads(p.read_text())["seconds"] for p in (cache / FOLDER).iterdir()
                if "seconds" in json.loads(p.read_text())]
    assert set(times) == {"float32 torch", *halves}  # no ONNX Runtime units on CUDA
    best = min(halves, key=times.__getitem__)
    if round(times["float32 torch"] / times[best], 3) >= MIN_SPEEDUP:  # as auto rounds it
        assert chosen.name == best and chosen.speedup > 0
    else:
        assert chosen.name == "float32" and f"{best} ran" in chosen.why
    print(f"\nauto on {torch.cuda.get_device_name()}: ms a sample "
          f"{ {k: round(1e3 * v, 3) for k, v in times.items()} }, chose {chosen.name}")
