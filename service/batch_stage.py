"""What the model's thread does with a gathered batch: one host buffer, the device, encoding.

Every request is copied into one reusable batch buffer (pinned on CUDA, so the batch moves to
the device in one transfer), its values checked there as the model will see them (NaN and
infinities refused, naming the field the request carried them in), the worker runs the
batch with the plan for the memory free now, the output comes back to the host, and each
request's rows are encoded by its own encoder. What a request got is an ``Outcome``, with
Triton's perf_analyzer breakdown of where its time went (``Timing``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from service.errors import field_error
from workers.worker import RunInfo, Worker

Encoder = Callable[[np.ndarray], Any]  # a request's rows of the output -> its encoded outputs


@dataclass(frozen=True)
class Timing:
    """Where one request's time went on the server (seconds).

    Pipelined (``service.pipeline_stage``), ``run_s`` spans both threads, from the batch's
    issue to its last encoding on the finisher's, its wait behind the batch before it
    included; on CUDA ``infer_s`` and the transfers in ``output_s`` are the device's times,
    read from the batch's CUDA events, not the host's time issuing them."""

    queue_s: float    # from submit to the start of its batch
    input_s: float    # decoding it (before submit) and copying it into the batch buffer
    infer_s: float    # the plan's run on the batch
    output_s: float   # the batch output to the host, and encoding its own rows
    run_s: float      # the batch on the worker thread, from its first copy to its last encoding
    load_wait_s: float = 0.0  # waiting for its model to load, before it was queued (0: loaded)


@dataclass(frozen=True)
class Outcome:
    """What one request got: its outputs and how its batch ran."""

    y: np.ndarray          # (n, *output_shape) float32: this request's rows (a view of the batch's)
    encoded: Any           # what its encoder made of ``y`` (None without an encoder)
    info: RunInfo          # the plans that ran the batch
    batch_samples: int     # samples in the batch it ran in
    timing: Timing
    table_version: int | None


class Rows(Protocol):
    """A request as the stage reads it: its samples, where it carried them, its encoder."""

    x: np.ndarray
    field: str
    encode: Encoder | None
    submitted: float  # perf_counter() when it was queued
    decode_s: float   # its decoding, before it was queued

    @property
    def n(self) -> int: ...


@dataclass(frozen=True)
class Done:
    """A batch's results, handed from the model's thread back to the loop."""

    # per request: its rows, their encoding (or the error encoding them), copy s, encode s
    rows: list[tuple[np.ndarray, Any, float, float]]
    info: RunInfo
    infer_s: float
    transfer_s: float  # the batch to the device and its output back: shared by its requests
    run_s: float
    samples: int       # in the batch

    def outcomes(self, batch: Sequence[Rows], started: float, version: int | None
                 ) -> list[Outcome | Exception]:
        """What each request of ``batch`` (run from ``started`` on, with table ``version``)
        got: its outcome, or the error that it alone got."""
        return [encoded if isinstance(encoded, Exception)
                else Outcome(y, encoded, self.info, self.samples,
                             Timing(queue_s=started - p.submitted, input_s=p.decode_s + copy_s,
                                    infer_s=self.infer_s, output_s=self.transfer_s + encode_s,
                                    run_s=self.run_s), version)
                for p, (y, encoded, copy_s, encode_s) in zip(batch, self.rows)]


def host_buffer(worker: Worker, n: int) -> tuple[Any, np.ndarray]:
    """A host buffer for n samples, at least the table's largest request (pinned on CUDA),
    and a numpy view of it."""
    return worker.model.host_buffer(max(n, worker.batch_max))


class BatchStage:
    """The batch buffer of one model's worker, and a batch's way through it (see the module
    doc). Used on the model's thread only."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._buffer: Any = None    # the batch buffer and its numpy view

    @property
    def buffer(self) -> Any:
        """The batch buffer now (a torch tensor, or an array for a model served without torch;
        None before the first batch)."""
        return self._buffer[0] if self._buffer is not None else None

    def host(self, n: int) -> tuple[Any, np.ndarray]:
        """The reusable host buffer for n samples (pinned on CUDA), grown when a batch is
        larger, and a numpy view of it."""
        if self._buffer is None or self._buffer[0].shape[0] < n:
            self._buffer = host_buffer(self.worker, n)
        return self._buffer

    def _write(self, batch: Sequence[Rows], host: np.ndarray
               ) -> tuple[int, list[float], dict[int, Exception]]:
        """Each request into its rows of the buffer (one copy), its values checked there: the
        samples written, each copy's seconds, the requests refused (their rows written over)."""
        copies: list[float] = []
        refused: dict[int, Exception] = {}
        offset = 0
        for i, p in enumerate(batch):
            c0 = time.perf_counter()
            rows = host[offset:offset + p.n]
            if p.x.dtype == rows.dtype:
                np.copyto(rows, p.x)
            else:  # a value out of the model's dtype's range becomes infinite: refused below
                with np.errstate(over="ignore", invalid="ignore"):
                    np.copyto(rows, p.x, casting="unsafe")
            # its values first read here, and checked as the model will see them (in its dtype:
            # a float64 1e39 is infinite in float32): NaN propagates through max and min, and
            # an infinity is one of them; a refused request's rows are written over
            if rows.dtype.kind == "f" and not (np.isfinite(rows.max()) and np.isfinite(rows.min())):
                refused[i] = field_error(p.field, "holds NaN or infinite values: send finite "
                                                  "numbers")
            else:
                offset += p.n
            copies.append(time.perf_counter() - c0)
        return offset, copies, refused

    def run(self, batch: Sequence[Rows]) -> Done:
        """The batch written, run, read back and encoded request by request."""
        t0 = time.perf_counter()
        model = self.worker.model
        buffer, host = self.host(sum(p.n for p in batch))
        total, copies, refused = self._write(batch, host)
        t1 = time.perf_counter()
        if not total:
            return Done([(host[:0], refused[i], copies[i], 0.0) for i in range(len(batch))],
                        RunInfo((), 0, 0), infer_s=0.0, transfer_s=0.0,
                        run_s=time.perf_counter() - t0, samples=0)
        x = model.to_input(buffer[:total])
        t2 = time.perf_counter()
        y, info = self.worker.infer(x)
        t3 = time.perf_counter()
        out = model.to_host(y, buffer)
        t4 = time.perf_counter()
        rows = encode_rows(batch, out, copies, refused)
        return Done(rows, info, infer_s=t3 - t2, transfer_s=(t2 - t1) + (t4 - t3),
                    run_s=time.perf_counter() - t0, samples=total)


def encode_rows(batch: Sequence[Rows], out: np.ndarray, copies: list[float],
             refused: dict[int, Exception]) -> list[tuple[np.ndarray, Any, float, float]]:
    """Each request's rows of the output and their encoding (an error encoding them goes to
    that request only), with its copy's and its encoding's seconds."""
    rows = []
    offset = 0
    for i, (p, copy_s) in enumerate(zip(batch, copies)):
        if i in refused:
            rows.append((out[:0], refused[i], copy_s, 0.0))
            continue
        e0 = time.perf_counter()
        mine = out[offset:offset + p.n]
        try:
            encoded = p.encode(mine) if p.encode is not None else None
        except Exception as exc:  # noqa: BLE001 - it goes to its own request only
            encoded = exc
        rows.append((mine, encoded, copy_s, time.perf_counter() - e0))
        offset += p.n
    return rows
