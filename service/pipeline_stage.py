"""The batch stage in two halves, so that the device runs while the host works: ``issue`` on the
model's thread, ``finish`` on its finisher's (``service.finisher``).

Run whole on the model's thread (``BatchStage.run``), a batch on CUDA leaves the device idle
while the host copies it in, waits for its output (a synchronizing copy) and encodes it, and
the next batch is gathered only after that. Here a batch is issued into one of two staging
slots, in turn: its rows written into the slot's pinned host buffer once the event after
that buffer's last host-to-device copy has completed, copied to the device on a copy stream
of its own, the compute stream waiting for the copy by an event, the plan run, and the
output copied back into the slot's pinned output buffer without waiting, an event recorded
after it. Issue returns then, and the batcher gathers and issues the next batch while the
device still runs this one. Finish waits for that event, copies the output out of the slot
(free again from then on) and encodes each request's rows. On the CPU nothing overlaps:
issue runs the model, finish encodes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.batch_stage import BatchStage, Done, Rows, encode_rows, host_buffer
from workers.worker import RunInfo, Worker

SLOTS = 2  # batches in flight at most: one finishing while the next is issued


class _Marks:
    """A slot's CUDA events, recorded anew by each batch issued into it (timed: the batch's
    transfers and its run are read from them)."""

    def __init__(self) -> None:
        import torch

        new = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self.copy_start, self.copied = new(), new()  # on the copy stream
        self.infer_start, self.infer_end, self.done = new(), new(), new()  # on the compute stream


@dataclass(eq=False)
class Slot:
    """One staging slot: a host input buffer (pinned on CUDA) and, on CUDA, a pinned output
    buffer and the events that say when each may be written again."""

    buffer: Any                 # the host input buffer (a torch tensor)
    host: np.ndarray            # its numpy view
    out: Any = None             # CUDA: the pinned output buffer (float32)
    marks: _Marks | None = None  # CUDA: its events
    free: threading.Event = field(default_factory=threading.Event)  # no batch of it in flight

    def __post_init__(self) -> None:
        self.free.set()


@dataclass(eq=False)
class Issued:
    """A batch issued: what finishing it needs (read on the finisher's thread only)."""

    batch: Sequence[Rows]
    slot: Slot
    total: int                  # samples that run (a refused request's rows are not among them)
    copies: list[float]         # each request's copy into the buffer, seconds
    refused: dict[int, Exception]
    started: float              # perf_counter() when the issue began
    info: RunInfo = RunInfo((), 0, 0)
    y: Any = None               # CPU: the output, float32 (on CUDA it lands in ``slot.out``)
    infer_s: float = 0.0        # CPU: the run, timed on the host
    transfer_s: float = 0.0     # CPU: casts to and from the model's dtype


class PipelinedStage(BatchStage):
    """A model's batch stage in two halves (see the module doc), its two slots used in turn.
    ``issue`` and ``host`` run on the model's thread, ``finish`` on the finisher's: they share
    a slot only through its ``free`` event and, on CUDA, its events."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self.slots: list[Slot] = []
        self._turn = 0                 # the slot the next batch is issued into
        self.copy_stream: Any = None   # CUDA: the stream host-to-device copies run on

    @property
    def buffer(self) -> Any:
        """The first slot's input buffer (None before ``host``)."""
        return self.slots[0].buffer if self.slots else None

    @property
    def buffers(self) -> list[Any]:
        """Every slot's input buffer."""
        return [s.buffer for s in self.slots]

    @property
    def cuda(self) -> bool:
        return self.worker.capture.model.device.type == "cuda"

    def host(self, n: int) -> tuple[Any, np.ndarray]:
        """Every slot's buffers for n samples, made now (at start: they are what stays); the
        first slot's input buffer and its view."""
        for i in range(SLOTS):
            self._grown(i, n)
        return self.slots[0].buffer, self.slots[0].host

    def _grown(self, i: int, n: int) -> Slot:
        """Slot i with room for n samples (made, or its buffers replaced by larger ones: only
        while no batch of it is in flight)."""
        import torch

        cuda = self.cuda
        if cuda and self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.worker.capture.model.device)
        if i == len(self.slots):
            self.slots.append(Slot(*host_buffer(self.worker, n), marks=_Marks() if cuda else None))
        slot = self.slots[i]
        if slot.buffer.shape[0] < n:
            slot.buffer, slot.host = host_buffer(self.worker, n)
        if cuda:
            self._out(slot, n, tuple(self.worker.capture.output_shape))
        return slot

    def _out(self, slot: Slot, n: int, shape: tuple[int, ...]) -> Any:
        """The slot's pinned output buffer, with room for n outputs of ``shape``."""
        import torch

        if slot.out is None or slot.out.shape[0] < n or tuple(slot.out.shape[1:]) != shape:
            slot.out = torch.empty((max(n, self.worker.batch_max), *shape), dtype=torch.float32,
                                   pin_memory=True)
            slot.out.numpy().fill(0)  # its pages now (as the input buffer's)
        return slot.out

    def _take(self, n: int) -> Slot:
        """The next slot in turn, for a batch of n samples: its last batch finished (the
        batcher keeps at most ``SLOTS`` in flight) and its host buffer's last copy done."""
        i = self._turn
        slot = self.slots[i] if i < len(self.slots) else None
        if slot is not None and not slot.free.is_set():
            raise RuntimeError(f"{self.worker.name}: staging slot {i} is still in flight: at "
                               f"most {SLOTS} batches may be")
        if slot is not None and slot.marks is not None:
            slot.marks.copied.synchronize()  # the device has read what the slot last held
        slot = self._grown(i, n)
        self._turn = (i + 1) % SLOTS
        slot.free.clear()
        return slot

    def issue(self, batch: Sequence[Rows]) -> Issued:
        """On the model's thread: ``batch`` written into the next slot and run (on CUDA,
        enqueued: its output lands in the slot once its ``done`` event has completed)."""
        t0 = time.perf_counter()
        slot = self._take(sum(p.n for p in batch))
        try:
            total, copies, refused = self._write(batch, slot.host)
            issued = Issued(batch, slot, total, copies, refused, t0)
            if total:
                (self._enqueue if slot.marks is not None else self._run_here)(issued)
            return issued
        except BaseException:
            slot.free.set()  # it will not be finished
            raise

    def _run_here(self, issued: Issued) -> None:
        """Not on CUDA: the run, synchronously; the output kept for ``finish``."""
        import torch

        loaded = self.worker.capture.model
        buffer = issued.slot.buffer
        t1 = time.perf_counter()
        x = buffer[:issued.total]
        if x.device != loaded.device or x.dtype != loaded.torch_dtype:  # bfloat16: as float32
            x = x.to(device=loaded.device, dtype=loaded.torch_dtype)
        t2 = time.perf_counter()
        y, issued.info = self.worker.infer(x)
        t3 = time.perf_counter()
        if y.device.type != "cpu" or y.dtype != torch.float32:
            y = y.to(device="cpu", dtype=torch.float32)
        if buffer.data_ptr() <= y.data_ptr() < buffer.data_ptr() + buffer.nbytes:
            y = y.clone()  # a model that returns its input: the slot is written again
        issued.y = y
        issued.infer_s, issued.transfer_s = t3 - t2, (t2 - t1) + (time.perf_counter() - t3)

    def _enqueue(self, issued: Issued) -> None:
        """On CUDA: the batch to the device on the copy stream, the run and the output's way
        back to the slot on the compute stream (the model's thread's current one), nothing
        waited for on the host."""
        import torch

        loaded = self.worker.capture.model
        slot, marks, copy = issued.slot, issued.slot.marks, self.copy_stream
        assert marks is not None
        compute = torch.cuda.current_stream(loaded.device)
        with torch.cuda.stream(copy):
            marks.copy_start.record(copy)
            x = slot.buffer[:issued.total].to(device=loaded.device, non_blocking=True)
            marks.copied.record(copy)
        compute.wait_event(marks.copied)
        # made on the copy stream, read on the compute stream: not reused before that is done
        x.record_stream(compute)
        if x.dtype != loaded.torch_dtype:  # bfloat16, written as float32
            x = x.to(dtype=loaded.torch_dtype)
        marks.infer_start.record(compute)
        y, issued.info = self.worker.infer(x)
        marks.infer_end.record(compute)
        del x
        if y.dtype != torch.float32:
            y = y.float()
        self._out(slot, issued.total, tuple(y.shape[1:]))[:issued.total].copy_(y, non_blocking=True)
        marks.done.record(compute)

    def finish(self, issued: Issued) -> Done:
        """On the finisher's thread: wait for the batch's output, take it out of its slot
        (free again from then on) and encode each request's rows."""
        try:
            out, infer_s, transfer_s = self._landed(issued)
        finally:
            issued.slot.free.set()
        rows = encode_rows(issued.batch, out, issued.copies, issued.refused)
        return Done(rows, issued.info, infer_s=infer_s, transfer_s=transfer_s,
                    run_s=time.perf_counter() - issued.started, samples=issued.total)

    @staticmethod
    def _landed(issued: Issued) -> tuple[np.ndarray, float, float]:
        """The batch's output on the host, its own (not the slot's), with the seconds of its
        run and of its transfers (on CUDA the device's, from the slot's events)."""
        slot, marks = issued.slot, issued.slot.marks
        if not issued.total:
            return slot.host[:0], 0.0, 0.0
        if marks is None:
            return issued.y.numpy(), issued.infer_s, issued.transfer_s
        marks.done.synchronize()
        c0 = time.perf_counter()
        out = slot.out[:issued.total].numpy().copy()
        copy_s = time.perf_counter() - c0
        infer_s = marks.infer_start.elapsed_time(marks.infer_end) / 1e3
        transfer_s = (marks.copy_start.elapsed_time(marks.copied)
                      + marks.infer_end.elapsed_time(marks.done)) / 1e3
        return out, infer_s, transfer_s + copy_s
