"""The pipelined batch stage on CUDA (service/pipeline_stage.py): two pinned staging slots used
in turn, host-to-device copies on a stream of their own, an issue that returns while the
device still runs, and outputs equal to model(x) at every batch size and however batches
overlap; and the service pipelining on CUDA by default.

On the CPU each test runs the same stage (there: the model run in ``issue``, the encoding in
``finish``) up to its first CUDA call, and skips there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from core.loaded import ModelSpec
from planner.graph.capture import capture
from planner.graph.inspect import arithmetic_tolerance
from planner.models import load_model
from planner.profiling.profiler import ProfileOptions, measure
from planner.solver.tables import build_table
from service.pipeline_stage import PipelinedStage
from tests.gpu.conftest import cuda_only
from workers.memory import MemoryProbe
from workers.worker import Worker

pytestmark = pytest.mark.gpu
SHAPE = (3, 64, 64)
BATCH_MAX = 4
SPIN_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s of a GPU's clock, the device held


class Rows:
    """A request as the stage reads it."""

    def __init__(self, x: np.ndarray) -> None:
        self.x, self.field, self.encode, self.submitted, self.decode_s = x, "inputs", None, 0.0, 0.0

    @property
    def n(self) -> int:
        return int(self.x.shape[0])


@pytest.fixture(scope="module")
def worker() -> Worker:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("squeezenet1_0", input_shape=SHAPE, device=device)))
    profile = measure(cap, ProfileOptions(batch_max=BATCH_MAX, repeats=1, warmup=1),
                      progress=False)
    return Worker(cap, build_table(profile, slot_count=32), MemoryProbe(device))


def _x(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SHAPE)).astype(np.float32)


def _staged(worker: Worker) -> PipelinedStage:
    stage = PipelinedStage(worker)
    stage.host(worker.batch_max)
    return stage


def _check(worker: Worker, x: np.ndarray, y: np.ndarray) -> None:
    loaded = worker.capture.model
    with torch.inference_mode():
        want = loaded.module(torch.from_numpy(x).to(loaded.device)).float().cpu().numpy()
    rtol, atol = arithmetic_tolerance(torch.float32, loaded.device.type)
    np.testing.assert_allclose(y, want, rtol=rtol, atol=atol * max(1.0, float(abs(want).max())))


def _run(stage: PipelinedStage, x: np.ndarray) -> Any:
    """One batch issued and finished: its Done."""
    return stage.finish(stage.issue([Rows(x)]))


def test_the_two_staging_slots_are_pinned_and_used_in_turn(worker: Worker) -> None:
    stage = _staged(worker)
    assert len(stage.slots) == 2
    assert stage.buffers[0].data_ptr() != stage.buffers[1].data_ptr()
    used = []
    for k, n in enumerate((1, 3, 4)):
        x = _x(n, k)
        issued = stage.issue([Rows(x)])
        used.append(stage.slots.index(issued.slot))
        _check(worker, x, stage.finish(issued).rows[0][0])
    assert used == [0, 1, 0]
    cuda_only(worker.capture.model.device.type, "pinned staging buffers and the copy stream")
    for slot in stage.slots:
        assert slot.buffer.is_pinned() and slot.out.is_pinned() and slot.marks is not None
        assert slot.out.dtype == torch.float32 and slot.out.shape[0] >= BATCH_MAX
    compute = torch.cuda.current_stream(worker.capture.model.device)
    assert stage.copy_stream is not None and stage.copy_stream != compute


def test_outputs_equal_the_model_at_every_batch_size(worker: Worker) -> None:
    stage = _staged(worker)
    dones = []
    for n in (1, 2, 3, 4, 6):  # 6: more than the table's largest request (pieces, buffers grown)
        x = _x(n, 20 + n)
        done = _run(stage, x)
        assert done.samples == n
        _check(worker, x, done.rows[0][0])
        dones.append(done)
    assert stage.slots[0].buffer.shape[0] >= 6  # grown (the 6 went into the first slot)
    cuda_only(worker.capture.model.device.type, "the run and transfers timed by the slot's events")
    for done in dones:
        assert done.infer_s > 0 and done.transfer_s > 0 and done.run_s >= done.infer_s


def test_back_to_back_batches_each_get_their_own_output(worker: Worker) -> None:
    """Two batches issued before either is finished; on CUDA with the copy stream held, so
    that both issues return while the first batch's copy and both runs are still pending:
    neither batch's buffer is written over, and each output is its own model(x)."""
    stage = _staged(worker)
    xs = [_x(4, 30), _x(4, 31), _x(2, 32)]
    for x in xs:  # warm: kernels chosen, memory cached, plans prepared
        _run(stage, x)
    first, second = (stage.issue([Rows(x)]) for x in xs[:2])
    for x, issued in zip(xs, (first, second)):
        _check(worker, x, stage.finish(issued).rows[0][0])
    device = worker.capture.model.device
    cuda_only(device.type, "copies and runs still pending on the device at the next issue")
    with torch.cuda.stream(stage.copy_stream):
        torch.cuda._sleep(SPIN_CYCLES)  # the copies wait behind it
    first, second = (stage.issue([Rows(x)]) for x in xs[:2])
    assert first.slot is not second.slot
    assert not first.slot.marks.copied.query(), "the first copy ran before the second issue"
    assert not second.slot.marks.done.query(), "an issue waited for the device"
    for x, issued in zip(xs, (first, second)):
        _check(worker, x, stage.finish(issued).rows[0][0])
    # each slot again, the copy stream held between them: the other's batch still pending
    again = stage.issue([Rows(xs[1])])
    with torch.cuda.stream(stage.copy_stream):
        torch.cuda._sleep(SPIN_CYCLES)
    third = stage.issue([Rows(xs[2])])
    assert again.slot is first.slot and third.slot is second.slot
    assert not third.slot.marks.copied.query()
    _check(worker, xs[1], stage.finish(again).rows[0][0])
    _check(worker, xs[2], stage.finish(third).rows[0][0])


def test_the_service_pipelines_on_cuda_by_default(device: str, tmp_path) -> None:
    from service.batch_stage import BatchStage
    from service.main import create_app
    from tests.service.conftest import run, running, settings_for

    settings = settings_for(tmp_path / "cache", tmp_path / "store", device=device,
                            models=["small=squeezenet1_0@3x64x64"], batch_max=4,
                            max_batch_delay_ms=0)
    app = create_app(settings)
    xs = [np.random.default_rng(k).standard_normal((k % 4 + 1, 3, 64, 64)).astype(np.float32)
          for k in range(6)]

    async def main() -> tuple[list[Any], Any]:
        async with running(app) as client:
            entry = app.state.registry.entries["small"]
            answers = await asyncio.gather(*(client.post("/infer?model=small",
                                                         json={"inputs": x.tolist()})
                                             for x in xs))
            return answers, entry

    answers, entry = run(main())
    module = entry.prepared.capture.model.module
    for x, answer in zip(xs, answers):
        assert answer.status_code == 200, answer.text
        with torch.inference_mode():
            want = module(torch.from_numpy(x).to(device)).float().cpu().numpy()
        got = np.asarray(answer.json()["outputs"], dtype=np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, float(abs(want).max())))
    stage = entry.batcher.stage
    if device == "cpu":
        assert type(stage) is BatchStage and entry.batcher.runs.finisher is None
    cuda_only(device, "the pipelined stage: auto turns it on for CUDA")
    assert isinstance(stage, PipelinedStage) and entry.batcher.runs.depth == 2
    assert all(b.is_pinned() for b in stage.buffers)
