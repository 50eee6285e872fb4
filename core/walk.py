"""How the executor lays out memory while it runs a Program: one walk, two back ends.

``walk`` replays a Program (``planner.solver.simulate`` defines its meaning) and says, step by
step, what to allocate, run, copy, fold and free. ``workers.executor.TorchBackend`` carries it
out on tensors, ``MemoryAccount`` on byte counts (as the device's allocator rounds them), so
the account's peak is exactly what the executor allocates, known from the profile alone:
``vbs plan`` walks every plan it keeps and the table stores the peak, the splits, the runs
and each unit's need, so nothing walks on the request path.

Buffers. Every boundary holds chunks: a step's output (a unit's tensor, a block's join
buffer) or the request. A step takes its samples as a view of the oldest chunk when they lie
inside it, else gathers them into a buffer of its own; a chunk is freed when its last sample
has been taken and read. A block's phase takes its fork the same way and its branches fold
into its join buffer in place (an ``add`` join takes over its first branch's output whole
instead of copying it). A unit that only writes into its input (``inplace``) keeps a chunk of
its own as its output. A run (``core.runs``: steps one runtime call executes) takes
its input as a step does and gives its last node's output; what the runtime holds inside it
counts while it runs.

Why the walk and not the DP's model is the truth: torch cannot free part of a tensor, so a
chunk read in several views stays whole until its last view, or is copied into pieces right
away (``splits``, kept when they lower the peak), and which is better depends on the whole
history of a boundary, which the DP's state (samples per boundary) does not hold. So the DP
searches, and this walk keys the table.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from core.errors import InvalidProgramError
from core.runtimes import TORCH
from core.sizes import allocation
from core.program import Step
from core.runs import RunMemory, TreeIndex, held_inside, run_runtime, step_runtime, \
    unit_figures
from core.tree import Layer, Node, Parallel, Series, fold_order

H = TypeVar("H")  # a back end's handle on a buffer: a tensor, or a byte count


class Backend(Protocol[H]):
    """What the walk asks of a back end; every method is one action on buffers."""

    def run(self, unit: Layer, x: H, samples: int, runtime: str) -> H:
        """Run a unit on ``samples`` samples on ``runtime``; returns its (newly allocated)
        output."""

    def run_in_place(self, unit: Layer, chunk: H, samples: int) -> H:
        """Run an ``inplace`` unit on all of a chunk nobody else reads; the chunk is its output."""

    def run_many(self, nodes: tuple[Node, ...], x: H, samples: int, runtime: str) -> H:
        """Run consecutive children of one series as one call of ``runtime`` (a run: see
        ``core.runs``); returns the last one's (newly allocated) output."""

    def view(self, chunk: H, start: int, samples: int) -> H:
        """Samples ``start..start+samples`` of a chunk, without copying."""

    def gather(self, producer: Node, samples: int) -> H:
        """A new buffer for ``samples`` samples of the boundary after ``producer``."""

    def copy(self, dst: H, dst_start: int, src: H, src_start: int, samples: int) -> None:
        """Copy samples from one buffer into another."""

    def open_join(self, block: Parallel, fork: H, samples: int) -> H:
        """A new join buffer for a phase of ``samples`` samples."""

    def fold(self, block: Parallel, join: H, start: int, fork: H, y: H | None, branch: int,
             samples: int, first: bool) -> H:
        """Fold a branch's sub-batch (``None``: the identity) into the join buffer; ``first``:
        no branch has folded these samples yet. Returns the join buffer from now on: an
        ``add`` join may take over a first output that covers all its samples instead of
        copying it, and drop its own buffer (the same size: what is held does not change)."""

    def free(self, buffer: H) -> None:
        """Release a buffer (a chunk, a gather buffer or a unit's output)."""

    def borrow(self, fork: H) -> H:
        """The fork as a branch reads it: the same memory, owned by the phase."""

    def split(self, producer: Node, chunk: H, sizes: list[int]) -> list[H]:
        """Copy a chunk into one new buffer per size (the original is freed after)."""


@dataclass
class _Chunk(Generic[H]):
    buffer: H
    samples: int
    taken: int = 0
    owned: bool = True  # a branch's fork is owned by its phase, not by the branch
    key: int | None = None  # the step that made it (None: the request or a borrowed fork)


@dataclass
class _Take(Generic[H]):
    tensor: H
    release: list[H] = field(default_factory=list)  # freed when the reading step finishes
    whole: H | None = None  # a buffer of the step's own, all taken: an inplace unit may keep it


@dataclass
class _Chain:
    series: Series
    boundaries: list[deque[_Chunk[Any]]]


@dataclass
class _Phase(Generic[H]):
    block: Parallel
    samples: int
    fork: _Take[H]
    join: H
    order: tuple[int, ...] = ()  # the branches in the order they fold (``fold_order``)
    pos: int = -1  # the position in ``order`` of the branch running now
    chain: _Chain | None = None
    folded: int = 0  # samples of the current branch folded so far
    parent: _Chain | None = None
    position: int = 0
    key: int = 0  # the step that opened it

    @property
    def branch(self) -> int:
        return self.order[self.pos]


def _new_chain(series: Series) -> _Chain:
    return _Chain(series, [deque() for _ in range(len(series.children) + 1)])


def _take(backend: Backend[H], chain: _Chain, position: int, samples: int,
          seen: dict[int, list[int | None]] | None = None) -> _Take[H]:
    """The next ``samples`` samples waiting at a boundary: a view, or a gather.

    ``seen`` records, per chunk, the size of every view taken from it (None for a gather).
    """
    queue = chain.boundaries[position]
    if sum(c.samples - c.taken for c in queue) < samples:
        raise InvalidProgramError(f"{chain.series.name}: a step wants {samples} samples at boundary "
                                  f"{position} but fewer are waiting")
    head = queue[0]
    if head.samples - head.taken >= samples:
        if seen is not None and head.key is not None:
            seen.setdefault(head.key, []).append(samples)
        whole = head.owned and head.taken == 0 and samples == head.samples
        view = backend.view(head.buffer, head.taken, samples)
        head.taken += samples
        release = []
        if head.taken == head.samples:
            queue.popleft()
            if head.owned:
                release.append(head.buffer)
        return _Take(view, release, head.buffer if whole else None)
    producer = chain.series.children[position - 1]
    buffer = backend.gather(producer, samples)
    filled = 0
    while filled < samples:
        head = queue[0]
        if seen is not None and head.key is not None:
            seen.setdefault(head.key, []).append(None)
        n = min(samples - filled, head.samples - head.taken)
        backend.copy(buffer, filled, head.buffer, head.taken, n)
        head.taken += n
        filled += n
        if head.taken == head.samples:
            queue.popleft()
            if head.owned:
                backend.free(head.buffer)  # its samples now live in the gather buffer
    return _Take(buffer, [buffer], buffer)


def _finish(backend: Backend[H], take: _Take[H]) -> None:
    for buffer in take.release:
        backend.free(buffer)
    take.release.clear()
    take.tensor = None  # type: ignore[assignment]  # drop the view: it pins its chunk
    take.whole = None


def walk(backend: Backend[H], root: Series, steps: Iterable[Step], x: H, samples: int,
         splits: dict[int, list[int]] | None = None,
         seen: dict[int, list[int | None]] | None = None,
         after_step: Callable[[int], None] | None = None,
         runs: dict[int, int] | None = None) -> H:
    """Run a program on a request ``x`` of ``samples`` samples; returns the output buffer.

    ``splits`` maps a step to the sizes its output chunk is copied into right away (so each
    piece is freed when its own reader finishes, instead of the chunk living until its last
    sample is read); ``seen`` collects how every chunk is read (see ``layout``);
    ``after_step(n)`` is called when the action of the last n steps is done. ``runs`` maps
    the first step of every run to its last (``core.runs``): those steps run as one
    call of their runtime (the plan says which: the DP chose where to cut).
    """
    return _Walk(backend, root, list(steps), splits or {}, seen, runs or {}).run(x, samples,
                                                                                  after_step)


class _Walk(Generic[H]):
    """One walk of a program: the chains and the open blocks (``_Phase``) as it goes.

    Each step is done by one method call, so that the tensors it handled are unreferenced when
    it returns: a buffer the walk frees must not be kept alive by a local variable."""

    def __init__(self, backend: Backend[H], root: Series, steps: list[Step],
                 splits: dict[int, list[int]], seen: dict[int, list[int | None]] | None,
                 runs: dict[int, int]) -> None:
        self.backend = backend
        self.steps = steps
        self.splits = splits
        self.seen = seen
        self.runs = runs
        self.index = TreeIndex.of(root)
        self.top = _new_chain(root)
        self.phases: list[_Phase[H]] = []

    def run(self, x: H, samples: int, after_step: Callable[[int], None] | None) -> H:
        """Every step in order, then the output gathered; ``after_step`` as ``walk`` says."""
        self.top.boundaries[0].append(_Chunk(x, samples, owned=False))  # the caller's request
        k, done = 0, 0
        while k < len(self.steps):
            if k and after_step is not None:
                after_step(done)
            last = self.step(k)
            done = last - k + 1
            k = last + 1
            self.next_branch()  # after step() returned: its locals no longer pin what it freed
        out = self.output(samples)
        if after_step is not None and self.steps:  # the last step's need includes the gather
            after_step(done)
        return out

    def chain(self) -> _Chain:
        """The series running now: the innermost open branch's, else the top one."""
        return self.phases[-1].chain if self.phases else self.top  # type: ignore[return-value]

    def step(self, k: int) -> int:
        """Do step k (and the run it starts); returns the index of the last step done."""
        step = self.steps[k]
        node, chain, position = self.locate(k, step)
        end = self.runs.get(k, -1)
        if end >= 0:
            if end < k or end >= len(self.steps):
                raise InvalidProgramError(f"step {k}: its run ends at step {end}, outside "
                                          f"{k}..{len(self.steps) - 1}")
            self.call(k, end, chain, position)
            return end
        take = _take(self.backend, chain, position, step.samples, self.seen)
        if isinstance(node, Layer):
            self.run_unit(k, node, take, chain, position)
        else:
            assert isinstance(node, Parallel)
            join = self.backend.open_join(node, take.tensor, step.samples)
            self.phases.append(_Phase(node, step.samples, take, join, fold_order(node),
                                      parent=chain, position=position, key=k))
        return k

    def locate(self, k: int, step: Step) -> tuple[Node, _Chain, int]:
        """Step k's node, and its series and position there, checked against the walk."""
        node = self.index.nodes.get(step.unit)
        if node is None:
            raise InvalidProgramError(f"step {k}: unknown unit {step.unit!r}")
        chain = self.chain()
        series, position = self.index.where[step.unit]
        if series is not chain.series:
            raise InvalidProgramError(f"step {k}: {step.unit!r} is not in {chain.series.name!r}, "
                                      "the series running now")
        if step.samples < 1:
            raise InvalidProgramError(f"step {k}: {step.unit!r} on {step.samples} samples")
        return node, chain, position

    def run_unit(self, k: int, unit: Layer, take: _Take[H], chain: _Chain, position: int) -> None:
        """Step k: one unit on the samples taken, in place when it may keep their chunk."""
        samples = self.steps[k].samples
        runtime = step_runtime(unit, self.steps[k])
        if unit.inplace and take.whole is not None and runtime == TORCH:
            out = self.backend.run_in_place(unit, take.whole, samples)  # the chunk is the output
            take.release.clear()
        else:
            out = self.backend.run(unit, take.tensor, samples, runtime)
        _finish(self.backend, take)
        self.deliver(chain, position, out, samples, unit, k)

    def call(self, k: int, end: int, chain: _Chain, position: int) -> None:
        """Steps k..end as one runtime call (a run)."""
        step = self.steps[k]
        nodes = self.index.run_nodes(self.steps, k, end)
        last = position + len(nodes) - 1
        if any(chain.boundaries[position + 1:last + 1]):  # it would overtake them
            raise InvalidProgramError(f"step {k}: its run ({k}, {end}) starts while samples wait "
                                      "between its units")
        take = _take(self.backend, chain, position, step.samples, self.seen)
        out = self.backend.run_many(nodes, take.tensor, step.samples, run_runtime(nodes[0], step))
        _finish(self.backend, take)
        self.deliver(chain, last, out, step.samples, nodes[-1], end)

    def deliver(self, chain: _Chain, position: int, out: H, n: int, node: Node, key: int) -> None:
        """Put a step's output where it goes: the next boundary (split into pieces when the
        plan says so), or the open block's join buffer."""
        if position + 1 < len(chain.series.children) or not self.phases or chain is self.top:
            queue = chain.boundaries[position + 1]
            sizes = self.splits.get(key)
            if sizes:
                for piece, size in zip(self.backend.split(node, out, sizes), sizes):
                    queue.append(_Chunk(piece, size))
                self.backend.free(out)
            else:
                queue.append(_Chunk(out, n, key=key))
            return
        phase = self.phases[-1]
        phase.join = self.backend.fold(phase.block, phase.join, phase.folded, phase.fork.tensor,
                                       out, phase.branch, n, phase.pos == 0)
        phase.folded += n
        self.backend.free(out)

    def next_branch(self) -> None:
        """Move on to the next branch when this one is done; close finished blocks."""
        while self.phases:
            phase = self.phases[-1]
            if phase.pos >= 0 and phase.folded < phase.samples:
                return
            phase.pos += 1
            phase.folded = 0
            if phase.pos < len(phase.order):
                if self.open_branch(phase):
                    return
                continue
            self.phases.pop()
            _finish(self.backend, phase.fork)
            assert phase.parent is not None
            self.deliver(phase.parent, phase.position, phase.join, phase.samples, phase.block,
                         phase.key)

    def open_branch(self, phase: _Phase[H]) -> bool:
        """Start the branch ``phase`` is at; an empty one (the identity) folds its fork at
        once. Whether the branch has steps to run."""
        branch = phase.block.branches[phase.branch]
        if branch.children:
            phase.chain = _new_chain(branch)
            phase.chain.boundaries[0].append(
                _Chunk(self.backend.borrow(phase.fork.tensor), phase.samples, owned=False))
            return True
        phase.join = self.backend.fold(phase.block, phase.join, 0, phase.fork.tensor, None,
                                       phase.branch, phase.samples, phase.pos == 0)
        phase.folded = phase.samples
        return False

    def output(self, samples: int) -> H:
        """The output boundary's samples as one buffer, once every sample has reached it."""
        if self.phases:
            raise InvalidProgramError(f"the program ends inside block {self.phases[-1].block.name!r}")
        top = self.top
        final = top.boundaries[-1]
        waiting = [c for queue in top.boundaries[:-1] for c in queue if c.samples > c.taken]
        if waiting or sum(c.samples for c in final) != samples:
            raise InvalidProgramError("the program does not bring every sample to the output")
        return (final.popleft().buffer if len(final) == 1
                else _take(self.backend, top, len(top.boundaries) - 1, samples).tensor)


@dataclass
class MemoryAccount:
    """A back end on byte counts: the executor's activation memory while a program runs.

    Every allocation is counted as the allocator rounds it (``granule``: 1 on CPU, 512 for
    CUDA's caching allocator); a unit's workspace at batch c is the one its step's runtime
    measured (beyond its rounded output), a run's what it holds inside its runtime
    (``held_inside``). ``needs[k]`` is the most held while step k ran (from the end of step
    k-1 to its own end: gathers, the run, folds and splits). ``inside=False`` leaves out what
    runtimes other than torch allocate inside their calls: what is left is exactly what the
    executor allocates itself (the tensors torch's profiler sees).
    """

    granule: int = 1
    inside: bool = True
    measured: RunMemory = field(default_factory=dict)  # runs measured whole: what they hold
    live: int = 0
    peak: int = 0
    step_peak: int = 0
    needs: list[int] = field(default_factory=list)

    def _level(self, level: int) -> None:
        if level > self.step_peak:
            self.step_peak = level
            if level > self.peak:
                self.peak = level

    def _alloc(self, nbytes: int) -> int:
        n = allocation(nbytes, self.granule)
        self.live += n
        self._level(self.live)
        return n

    def end_step(self, steps: int = 1) -> None:
        self.needs.extend([self.step_peak] * steps)  # a run's steps share its need
        self.step_peak = self.live

    def _ws(self, unit: Layer, samples: int, runtime: str) -> int:
        if runtime != TORCH and not self.inside:
            return 0
        return unit_figures(unit, runtime, samples)[1]

    def run(self, unit: Layer, x: int, samples: int, runtime: str = TORCH) -> int:
        out = allocation(unit.out_bytes * samples, self.granule)
        self._level(self.live + self._ws(unit, samples, runtime) + out)
        return self._alloc(unit.out_bytes * samples)

    def run_many(self, nodes: tuple[Node, ...], x: int, samples: int, runtime: str) -> int:
        inner = (held_inside(nodes, samples, runtime, self.granule, self.measured)
                 if self.inside else 0)
        out = nodes[-1].out_bytes * samples  # type: ignore[union-attr]
        self._level(self.live + inner + allocation(out, self.granule))
        return self._alloc(out)

    def run_in_place(self, unit: Layer, chunk: int, samples: int) -> int:
        self._level(self.live + self._ws(unit, samples, TORCH))
        return chunk

    def view(self, chunk: int, start: int, samples: int) -> int:
        return 0

    def gather(self, producer: Node, samples: int) -> int:
        return self._alloc(producer.out_bytes * samples)

    def copy(self, dst: int, dst_start: int, src: int, src_start: int, samples: int) -> None:
        return None

    def open_join(self, block: Parallel, fork: int, samples: int) -> int:
        return self._alloc(block.out_bytes * samples)

    def fold(self, block: Parallel, join: int, start: int, fork: int, y: int | None, branch: int,
             samples: int, first: bool) -> int:
        if y is not None and block.join not in ("cat", "add", "mul"):
            # Other joins compute into a temporary before copying into the join buffer.
            self._level(self.live + allocation(block.out_bytes * samples, self.granule))
        return join

    def free(self, buffer: int) -> None:
        self.live -= buffer

    def borrow(self, fork: int) -> int:
        return 0

    def split(self, producer: Node, chunk: int, sizes: list[int]) -> list[int]:
        return [self._alloc(producer.out_bytes * n) for n in sizes]


def account(root: Series, steps: Iterable[Step], samples: int, *, granule: int = 1,
            splits: dict[int, list[int]] | None = None,
            seen: dict[int, list[int | None]] | None = None,
            runs: dict[int, int] | None = None,
            inside: bool = True, measured: RunMemory | None = None) -> MemoryAccount:
    """Walk ``steps`` on ``samples`` samples on byte counts; the account holds the peak and
    every step's need. The request is not counted: it was allocated before the run (and
    before the memory probe that chose the plan), and its caller holds it throughout."""
    acc = MemoryAccount(granule, inside, measured or {})
    walk(acc, root, list(steps), 0, samples, splits, seen, after_step=acc.end_step, runs=runs)
    return acc


def executor_peak(root: Series, steps: Iterable[Step], samples: int, *, granule: int = 1,
                  splits: dict[int, list[int]] | None = None,
                  runs: dict[int, int] | None = None, inside: bool = True,
                  measured: RunMemory | None = None) -> int:
    """Peak bytes the executor allocates for activations running ``steps`` on ``samples``
    (``inside``: with what other runtimes hold inside their calls)."""
    return account(root, steps, samples, granule=granule, splits=splits, runs=runs,
                   inside=inside, measured=measured).peak


@dataclass(frozen=True)
class Layout:
    """How the executor runs a program: the outputs it splits, its exact peak, each step's
    need, and its runs (as given)."""

    splits: dict[int, list[int]]
    peak: int
    needs: tuple[int, ...]
    peak_without_splits: int
    runs: tuple[tuple[int, int], ...] = ()


def layout(root: Series, steps: Iterable[Step], samples: int, *, granule: int = 1,
           runs: Iterable[tuple[int, int]] = (), measured: RunMemory | None = None) -> Layout:
    """The executor's layout of a program with its runs at its lowest peak: whether to split
    chunks.

    A chunk read in several views stays whole until its last view, unless it is split into
    one piece per view right after it is made (a copy, so both exist for a moment). Two
    walks: as is, and with every such chunk split; the splits are kept only when they lower
    the peak (a greedy search over single splits, one walk each, found the same peaks).
    """
    steps = list(steps)
    runs = tuple(sorted(runs))
    seen: dict[int, list[int | None]] = {}
    plain = account(root, steps, samples, granule=granule, seen=seen, runs=dict(runs),
                    measured=measured)
    splits = {k: [n for n in sizes if n is not None] for k, sizes in sorted(seen.items())
              if len(sizes) > 1 and None not in sizes}
    if splits:
        split = account(root, steps, samples, granule=granule, splits=splits, runs=dict(runs),
                        measured=measured)
        if split.peak < plain.peak:
            return Layout(splits, split.peak, tuple(split.needs), plain.peak, runs)
    return Layout({}, plain.peak, tuple(plain.needs), plain.peak, runs)
