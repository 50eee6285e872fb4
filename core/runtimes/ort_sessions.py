"""ONNX Runtime under the plan: one InferenceSession per run of units, outputs bound in place.

This module has no torch: ``core.runtimes.onnxrt`` binds torch tensors to these sessions, and
``core.runtimes.ort_arrays`` numpy arrays (a worker that runs stored graphs without torch).

A run (consecutive children of one series, at one batch size) is composed from the units'
ONNX graphs (``core.runtimes.onnx_compose``) and gets a session the first time it runs;
sessions are kept by run, the least recently used given back beyond ``max_sessions``
(`VBS_ORT_SESSIONS`), and before a session is made while memory is short (``room``): each
holds a thread and its plan; the weights are the model's, held once for all its sessions
(``core.runtimes.ort_weights``). Inputs and outputs are bound with I/O binding to the caller's
buffers, so ONNX Runtime allocates only what lives inside a run: the activations between
its units and its kernels' scratch, which is the run's workspace in the model of memory.

Every session of the process shares one arena that grows by what is asked, no more
(``kSameAsRequested``): sessions are many, and an arena each would multiply held memory by
their number. The arena keeps what calls used, or gives its free regions back when each call
returns (``arena=False``, ``run_options``): a call's activations are then one block, planned
from its first call (ONNX Runtime's memory pattern), mapped and unmapped once a call. What
it keeps can also be given back between calls (``give_back_arena``: the memory owner does so
at rest and when memory is short, ``workers.host_cache``).

Each session has its own intra-op threads (as many as torch uses) that spin between the
operators of a call, as ONNX Runtime's defaults do (a model of a hundred small operators
would otherwise pay a wake-up for each), and stop spinning the moment the call
returns (``session.force_spinning_stop``): the pools of sessions that are not running are
asleep, so they neither take the cores from the one that runs nor cost an idle server CPU.
ONNX Runtime's process-wide pools (``set_global_thread_pool_sizes``) are not used: that
switch applies to a session's own pool only, and a global pool spins on after each call.
``spin=False`` (`VBS_ORT_SPIN=0`) makes the threads sleep between operators too.
"""

from __future__ import annotations

import gc
import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from core.errors import ExecutionError, OutOfMemoryError
from core.malloc import LARGE_BLOCK, map_large_blocks, trimmer
from core.runtimes.onnx_compose import CannotCompose, UnitGraphs
from core.runtimes.ort_memory import reset_peak, status_bytes
from core.runtimes.ort_weights import SharedWeights
from core.runs import TreeIndex
from core.tree import Node

NAME = "onnxruntime"
VERSION = ort.__version__
NUMPY = {"float32": np.float32}  # the dtypes its CPU kernels run here
_SETUP = threading.Lock()
_READY = False


def _environment() -> None:
    """One arena for every session of the process (set up once)."""
    global _READY
    with _SETUP:
        if _READY:
            return
        ort.set_default_logger_severity(3)  # its optimiser's notes are not the user's business
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                 ort.OrtMemType.DEFAULT)
        # max_mem 0 (no cap), extend by what is asked (1), default chunk and dead-byte sizes
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
        _READY = True


# The policy of every session's threads: spin while a call runs (unless told not to), asleep
# once it returns.
SPIN = "session.intra_op.allow_spinning"
STOP = "session.force_spinning_stop"
# what making a session takes per byte of its graph's weights, at its peak: the composed
# graph (its large weights written to a file from the units' graphs, never copied whole),
# the copies its optimiser makes in its own layouts (the graph's weights reach it through a
# file it maps, ``ort_weights``), then the weights kept, its plan
# (tests/core/test_runtimes.py checks the bound). Whole graphs made alone peaked at 0.5-3.5x
# (4-6.2x when they were given as a serialized graph), but 4 let a served process of eight
# models be OOM-killed at its limit (docs/benchmarks.md section 8), so the bound stays
# where nothing was measured for the model: `vbs plan` measures its sessions' peaks in a fresh
# process of the worker without torch (``workers.load_cost``), and the service asks that
# (``served_factor``) free instead
SESSION_GROWTH = 7
# a measured factor is served with this much more (a session made later, of a shorter run,
# has more of its own beside its weights), and at least FLOOR
FACTOR_MARGIN = 0.5
FACTOR_FLOOR = 1.5
SEEN_WEIGHTS = 1 << 20  # sessions of fewer weight bytes are not measured per byte
# glibc's free pages back to the kernel, around a session's making: what it allocated and freed
# while it was made (a weight read from its file, then packed) stays on the heap otherwise,
# resident and counted as the session's; and pages freed before would serve what it keeps
# without the process growing, so that would not count (docs/benchmarks.md, section 13)
_TRIM = trimmer()


def served_factor(measured: float) -> float:
    """The bytes a session asks free per byte of its weights, from the most its model's
    sessions grew the process by at their peak per byte when `vbs plan` made them
    (``OrtSessions.making_seen``): never above ``SESSION_GROWTH``, the bound where nothing was
    measured (0)."""
    if measured <= 0:
        return float(SESSION_GROWTH)
    return round(min(float(SESSION_GROWTH), max(FACTOR_FLOOR, measured * (1 + FACTOR_MARGIN))), 3)


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of a graph's initializers."""
    return sum(len(t.raw_data) or 4 * len(t.float_data) for t in model.graph.initializer)


def give_back_freed_memory() -> bool:
    """Make glibc give large freed buffers back to the kernel at once (its mmap threshold fixed
    at ``core.malloc.LARGE_BLOCK``; by default it rises to 32 MiB after the first such free,
    and buffers below it stay on the heap): the blocks the arena gives back then leave the
    process's working set. Process-wide; False where malloc is not glibc's."""
    return map_large_blocks(LARGE_BLOCK)


def session_options(threads: int, *, spin: bool = True) -> ort.SessionOptions:
    """Options of every session: ``threads`` intra-op threads that spin between operators
    while a call runs (sleep, without ``spin``) and stop when it returns, the shared arena."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.add_session_config_entry(SPIN, "1" if spin else "0")
    options.add_session_config_entry(STOP, "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def run_options(arena: bool) -> ort.RunOptions | None:
    """A call's options: none (the arena keeps what the call used), or, without ``arena``,
    the arena's free regions given back when the call returns (with glibc mapping them
    alone, ``give_back_freed_memory``, they leave the working set): a call still allocates
    its activations as one block planned from the first call's (ONNX Runtime's memory
    pattern), one mapping a call, not one each."""
    if arena:
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


_TINY: list[ort.InferenceSession] = []  # give_back_arena's session, made on first use


def start() -> None:
    """ONNX Runtime's set-up of the process, done before its first session would do it: the
    shared arena, and a first session (``give_back_arena``'s), which loads what every later
    one shares (about 9 MB on the CPU). A measurement of one session's making starts here, or
    it counts the process's set-up as the session's."""
    _environment()
    _tiny()


def give_back_arena() -> bool:
    """Give the shared arena's free regions back now, between calls (a call running keeps
    its own): one call of a one-number Identity graph with the arena's shrinkage asked, which
    shrinks the arena its session allocates from, every session's. False where no session
    has been made (nothing to give back)."""
    if not _READY:
        return False
    _tiny().run(None, {"x": np.zeros(1, np.float32)}, run_options(False))
    return True


def _tiny() -> ort.InferenceSession:
    """A session of a one-number Identity graph, made once."""
    if not _TINY:
        with _SETUP:
            if not _TINY:
                one = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1])
                       for n in ("x", "y")]
                graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])],
                                               "give_back", one[:1], one[1:])
                model = onnx.helper.make_model(
                    graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
                _TINY.append(ort.InferenceSession(model.SerializeToString(),
                                                  session_options(1, spin=False)))
    return _TINY[0]


@dataclass
class _Run:
    session: ort.InferenceSession
    binding: threading.local
    used: int = 0  # when it last ran (OrtUnits' clock): the least recently used goes first
    held: int = 0  # how much the process grew making it, at least its weights


class OrtSessions:
    """Sessions for the runs of one model, by run (first and last node), made on first use or
    ahead (``prepare``), the least recently used given back beyond ``max_sessions`` or while
    memory is short; ``run_at`` binds a call's input and output by address and runs it.
    ``graphs`` are the model's unit graphs (``core.runtimes.onnx_compose``)."""

    name = NAME

    def __init__(self, graphs: UnitGraphs, threads: int, *, arena: bool = True,
                 spin: bool = True, max_sessions: int = 128,
                 room: Callable[[], int] | None = None, making_factor: float | None = None) -> None:
        _environment()
        self.graphs = graphs
        self.model_name = graphs.shapes.name
        self.threads = max(1, threads)
        self.spin = spin
        self._runs: dict[tuple[str, str], _Run] = {}
        self._lock = threading.Lock()
        self._clock = itertools.count(1)  # next() is atomic under the GIL: no lock on a hit
        self.max_sessions = max(1, max_sessions)
        self._index = TreeIndex.of(graphs.shapes.tree)
        self._run_options = run_options(arena)
        self._room = room  # bytes free now, read before a session is made (None: not read)
        # every weight once for all the runs' sessions (``core.runtimes.ort_weights``), its
        # files beside the graphs' weights file where they have one (a disk: the cache
        # directory), not in the temporary directory (a tmpfs in the containers: memory)
        self._folder = graphs.weights.folder if graphs.weights is not None else None
        self._weights = SharedWeights(folder=self._folder)
        self._making = 0  # the most a session asked to be free before it was made
        # what a session asks free per byte of its weights (``served_factor``; None: the bound)
        self.making_factor = float(making_factor) if making_factor else float(SESSION_GROWTH)
        self._seen = 0.0  # the most a session made here grew the process by per weight byte

    def reason(self, node: Node) -> str:
        """Why ``node`` cannot run on ONNX Runtime ('' when it can)."""
        return self.graphs.reason(node)

    def nodes(self, first: str, last: str) -> tuple[Node, ...]:
        """The children of one series from ``first`` to ``last``."""
        nodes = self._index.span(first, last)
        if nodes is None:
            raise ExecutionError(f"{first!r}..{last!r} is not a run of one series")
        return nodes

    def prepare(self, nodes: tuple[Node, ...], samples: int) -> None:
        """Build the session of a run now, not when it first runs (one session runs it at
        every batch size)."""
        self._run(nodes[0].name, nodes[-1].name)

    @property
    def sessions(self) -> int:
        return len(self._runs)

    @property
    def held_bytes(self) -> int:
        """The model's weights as its sessions share them (once), and what the process grew
        by making each session it keeps (host memory: a cgroup's reading counts it as used
        already)."""
        return self._weights.held_bytes + sum(run.held for run in list(self._runs.values()))

    @property
    def cached_bytes(self) -> int:
        return 0

    @property
    def making_bytes(self) -> int:
        """The most memory a session of these runs asked to be free before it was made (its
        ``making_factor`` x weights), asked or made already: what making it again asks."""
        return self._making

    @property
    def making_seen(self) -> float:
        """The most a session made here grew the process's peak resident set by while it was
        made, per byte of its weights (0: none made). In a fresh process (`vbs plan`'s
        measurement) that is what making it costs; in a busy one, other threads' allocations
        meanwhile count too."""
        return self._seen

    def give_back(self) -> None:
        """Give back the shared arena's free regions (every session's: ``give_back_arena``)."""
        give_back_arena()

    def release(self) -> None:
        """Give back every session (a call still running keeps its own)."""
        with self._lock:
            self._runs.clear()
            # a new set: a call still running keeps its session, which keeps the old one
            self._weights = SharedWeights(folder=self._folder)
        gc.collect()

    def _run(self, first: str, last: str) -> _Run:
        key = (first, last)
        found = self._runs.get(key)
        if found is not None:
            found.used = next(self._clock)
            return found
        with self._lock:
            found = self._runs.get(key)
            if found is None:
                while len(self._runs) >= self.max_sessions:
                    self._evict()
                # its making starts with its graph composed (the layers' graphs parsed, its small
                # weights copied): the peak is measured from here (where the kernel lets the
                # process reset its peak)
                composing: int | None = status_bytes("VmRSS")
                try:
                    reset_peak()
                except OSError:
                    composing = None
                try:  # its large weights referred to in the units' graphs, never copied here
                    run = self.graphs.compose_referring(self.nodes(first, last),
                                                        self._weights.min_bytes)
                except CannotCompose as exc:
                    raise ExecutionError(f"{self.model_name}: {first}..{last} cannot run on "
                                         f"ONNX Runtime: {exc}") from exc
                weights = run.weight_bytes
                need = math.ceil(self.making_factor * weights)
                self._making = max(self._making, need)
                self._make_room(first, last, need)
                _TRIM()  # what earlier work left free on the heap is not this session's
                before = status_bytes("VmRSS")
                session = self._weights.session(run.model, session_options(
                    self.threads, spin=self.spin), sources=run.sources)
                if composing is not None and weights >= SEEN_WEIGHTS:  # below: its own rules
                    self._seen = max(self._seen, (status_bytes("VmHWM") - composing) / weights)
                _TRIM()  # nor what making it freed: what it keeps is what stays
                # what the process grew by, less the weights it added to the shared ones
                # (counted once, in held_bytes), and at least its graph, which it copies (the
                # weights too small to share among them), and the weights it packs and owns:
                # where it reused pages freed before, the growth shows less than it keeps
                grown = max(self._weights.last_graph_bytes + self._weights.last_packed_bytes,
                            status_bytes("VmRSS") - before - self._weights.last_new_bytes)
                found = self._runs[key] = _Run(session, threading.local(), held=grown)
            found.used = next(self._clock)
        return found

    def _evict(self) -> None:
        """Give back the least recently used session (a call still running keeps its own)."""
        del self._runs[min(self._runs, key=lambda k: self._runs[k].used)]

    def _make_room(self, first: str, last: str, need: int) -> None:
        """Before a session is made: ``need`` bytes free (``room``), the least recently used
        sessions given back until they are; else OutOfMemoryError (the worker tries a smaller
        plan, the request gets 503): a session made beyond the memory free would be growth no
        plan counts, and under a memory limit the kernel's kill."""
        if self._room is None:
            return
        # what giving back every session would free: none is given back where even that falls
        # short (the sessions a smaller plan runs on stay)
        if self._room() + sum(run.held for run in self._runs.values()) + \
                self._weights.held_bytes < need:
            self._raise_short(first, last, need)
        while self._room() < need and self._runs:
            self._evict()
            if not self._runs:  # the shared weights too (a call still running keeps its own)
                self._weights = SharedWeights(folder=self._folder)
            gc.collect()
        if self._room() < need:
            self._raise_short(first, last, need)

    def _raise_short(self, first: str, last: str, need: int) -> None:
        free = self._room() if self._room is not None else 0
        raise OutOfMemoryError(
            f"{self.model_name}: ONNX Runtime's session for {first}..{last} needs about {need} "
            f"bytes and {free} are free: a smaller plan, or more memory")

    def run_at(self, first: str, last: str, dtype: type, x: tuple[int, tuple[int, ...]],
               out: tuple[int, tuple[int, ...]]) -> None:
        """Run ``first..last`` on the contiguous input at address ``x[0]`` of shape ``x[1]``,
        writing the contiguous output at ``out[0]`` of shape ``out[1]`` (numpy ``dtype``)."""
        run = self._run(first, last)
        bound = run.binding
        binding = getattr(bound, "io", None)
        if binding is None:
            binding = bound.io = run.session.io_binding()
            bound.x = bound.y = None
        # bound by address: the same address and shape as the last call's (a batcher's
        # reused buffer, an output the allocator gave back) is bound already; binding again
        # costs tens of microseconds of ONNX Runtime's Python right after a model's call
        if x != bound.x:
            binding.bind_input("x", "cpu", 0, dtype, x[1], x[0])
            bound.x = x
        if out != bound.y:
            binding.bind_output("y", "cpu", 0, dtype, out[1], out[0])
            bound.y = out
        run.session.run_with_iobinding(binding, self._run_options)
