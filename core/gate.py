"""One gate between torch.fx traces and every module call in the process (``MODULE_GATE``).

Plain threading, no torch: a worker that runs only ONNX Runtime sessions (``core.compiled``)
imports it without torch, and the gate stays one object for the process either way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ModuleGate:
    """Keeps torch.fx traces apart from every other module call in the process.

    Why: ``fx.symbolic_trace`` patches ``torch.nn.Module.__call__`` for the whole process while
    it runs, so a module called from another thread meanwhile (another model's batch, or its
    profile) goes into that trace: the other call fails ("module is not installed as a
    submodule") or the trace records foreign ops. A service that loads one model while it
    serves another (one torch thread per model) must not let the two meet. A trace takes the
    gate alone (``tracing``); module calls share it (``running``). A waiting trace goes first:
    new calls wait behind it, so a trace is not starved by models that never stop serving.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._tracing = False
        self._waiting_traces = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._cond:
            while self._tracing or self._waiting_traces:
                self._cond.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        with self._cond:
            self._waiting_traces += 1
            try:
                while self._tracing or self._running:
                    self._cond.wait()
            finally:
                self._waiting_traces -= 1
            self._tracing = True
        try:
            yield
        finally:
            with self._cond:
                self._tracing = False
                self._cond.notify_all()


MODULE_GATE = ModuleGate()
