"""The solver's view of a Profile: chains of units with boundary sizes and runs, per objective.

The division tree is flattened into chains (``Chain``): the root series, and one chain per
branch of every parallel block. A chain of n units has n+1 boundaries; ``sizes[k]`` is the
bytes per sample held at boundary k (``sizes[0]`` feeds unit 0, ``sizes[n]`` is the last
unit's output). A branch chain's input is 0: it is the block's fork, already held (the
paper's branch collapse). Its output is 0 too when a layer ends the branch, folded into the
block's join buffer, but that layer's output is allocated by torch before the fold, so its
size is added to the layer's workspace: the paper counts it as 0, which no executor can do. A unit is a
layer (``layer`` or ``opaque``: run as a whole) or a parallel block whose branches are chains.

A unit's own figures (``cost``, ``time``, ``ws``) are those of a step the executor runs
itself: on torch where the profile names runtimes (``inf`` where the runtime choice keeps the
unit off torch), else on the profile's only kernels. What a runtime that runs units in calls
(ONNX Runtime, CUDA graphs) does is a chain's ``RunTable``: for every span of consecutive children of one
series it can run as one call, at every batch size, what that call costs
(``planner.solver.pricing``) and needs (``core.runs.run_peak``); a single unit on
that runtime is a span of one.

Every solver, the simulator and the baselines read sizes, workspaces, runs and costs from
here only, so there is one model of memory and one of time in code (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from core import runtimes as rt
from core.errors import ProfileError, UsageError
from planner.solver.pricing import Pricing
from core.runs import CallCost, RunMemory, TreeIndex, call_cost, held_inside, \
    measured_runs, run_peak, supports, unit_figures
from core.tree import Layer, Node, Parallel, Profile, Series, iter_layers, node_to_json

OBJECTIVES = ("time", "energy")
# Every strategy the solver knows (``planner.solver.solve``), here where no numba is imported:
# `vbs`'s parser lists them without loading the DP.
SOLVERS = ("vbs", "paper", "fbs", "fbs-best", "greedy")


@dataclass(frozen=True, eq=False)
class Unit:
    """One unit of a chain: a layer, or a parallel block with its branch chains."""

    name: str
    is_block: bool
    cost: tuple[float, ...]  # objective total for b = 1..B samples at once (a block: the fold)
    time: tuple[float, ...]  # seconds for b = 1..B samples at once (a block: the fold)
    ws: tuple[int, ...]      # workspace bytes at b = 1..B (0 for a block)
    branches: tuple["Chain", ...] = ()
    join: str = ""

    def cost_at(self, b: int) -> float:
        return self.cost[b - 1]

    def time_at(self, b: int) -> float:
        return self.time[b - 1]

    def ws_at(self, b: int) -> int:
        return self.ws[b - 1]


@dataclass(frozen=True)
class RunTable:
    """The runs of one chain on one runtime: ``spans[(i, j)]`` = (cost, need) of units i..j
    (consecutive children of one series, blocks whole) as one call on b = 1..B samples; need
    in bytes, the input as the chain counts it included."""

    runtime: str
    spans: dict[tuple[int, int], tuple[tuple[float, ...], tuple[int, ...]]]


@dataclass(frozen=True, eq=False)
class Chain:
    """Units run one after another, with the bytes per sample held at each boundary."""

    cid: int
    units: tuple[Unit, ...]
    sizes: tuple[int, ...]  # len(units) + 1 boundaries; a branch chain's ends are 0
    parent: tuple[int, int, int] | None = None  # (parent chain id, block position, branch index)
    nodes: tuple[Layer | Parallel, ...] = ()  # the tree's node of every unit
    runs: RunTable | None = None  # what a runtime that runs units in calls can run as one

    @property
    def n(self) -> int:
        return len(self.units)


@dataclass(frozen=True, eq=False)
class Instance:
    """A profile flattened into chains for one objective; ``chains[0]`` is the root."""

    batch_max: int
    objective: str
    chains: tuple[Chain, ...]
    fingerprint: str = ""
    locate: dict[str, tuple[int, int]] = field(default_factory=dict)  # unit name -> (chain, position)
    tree: Series | None = None  # the profile's tree: the executor's layout walks it
    granule: int = 1            # the device allocator's rounding (core.sizes.allocation)
    # the unit runtimes the profile measured (core.runtimes; () = none named: torch), how
    # they were to be chosen (auto, onnxruntime, torch) and each one's fixed cost of a call
    runtimes: tuple[str, ...] = ()
    runtime_choice: str = ""
    calls: dict[str, CallCost] = field(default_factory=dict)
    run_memory: RunMemory = field(default_factory=dict)  # runs the profiler measured whole
    # the tables of the worker without torch (a ``lean`` profile): every block the named
    # runtime takes runs whole inside one of its runs (that worker folds no join itself)
    whole_blocks: bool = False
    grouping: str = ""  # the runtime whose units run in calls of runs (RunTable), '' for none
    # what every span of every RunTable holds inside its runtime (``runs.held_inside``): the
    # walk reads it instead of working it out again for every call of every plan it lays out
    spans_held_inside: RunMemory = field(default_factory=dict)

    @property
    def root(self) -> Chain:
        return self.chains[0]

    @cached_property
    def unit_names(self) -> tuple[str, ...]:
        """Every unit name in execution order (a block before its branches' units)."""
        names: list[str] = []

        def walk(chain: Chain) -> None:
            for unit in chain.units:
                names.append(unit.name)
                for branch in unit.branches:
                    walk(branch)

        walk(self.root)
        return tuple(names)

    @cached_property
    def global_units(self) -> tuple[Unit, ...]:
        """Every unit, chains in id order and units in position order: the DP's numbering."""
        return tuple(u for ch in self.chains for u in ch.units)

    @cached_property
    def global_index(self) -> dict[str, int]:
        return {u.name: g for g, u in enumerate(self.global_units)}

    def unit(self, name: str) -> Unit:
        cid, pos = self.locate[name]
        return self.chains[cid].units[pos]

    @property
    def index(self) -> TreeIndex:
        assert self.tree is not None
        return TreeIndex.of(self.tree)

    @cached_property
    def pricing(self) -> Pricing:
        """The objective's prices of steps, runs and programs (``planner.solver.pricing``)."""
        return Pricing(self.index, self.calls, self.objective)

    @cached_property
    def time_pricing(self) -> Pricing:
        """Seconds of steps, runs and programs, whatever the objective."""
        return self.pricing if self.objective == "time" else Pricing(self.index, self.calls, "time")

    @cached_property
    def depth(self) -> int:
        """How many parallel blocks nest at most (0 for a chain)."""
        def d(chain: Chain) -> int:
            return max((1 + max(d(b) for b in u.branches) for u in chain.units if u.is_block),
                       default=0)
        return d(self.root)


def _flatten(node: Node) -> list[Layer | Parallel]:
    """A series' units in order, nested series spliced in."""
    if isinstance(node, Series):
        out: list[Layer | Parallel] = []
        for child in node.children:
            out.extend(_flatten(child))
        return out
    return [node]


def _costs(values: tuple[float, ...], what: str, name: str, batch_max: int,
           *, optional: bool) -> tuple[float, ...]:
    if not values:
        if optional:
            return (0.0,) * batch_max
        raise UsageError(f"unit {name!r} has no {what!r} list; objective {what!r} needs one on "
                         f"every layer (b = 1..{batch_max}); profile it again or use objective 'time'")
    if len(values) != batch_max:
        raise ProfileError(f"unit {name!r}: {what!r} has {len(values)} values, batch_max is {batch_max}")
    return tuple(float(v) for v in values)


def build_instance(profile: Profile, objective: str = "time", *, count_request: bool = True
                   ) -> Instance:
    """Flatten ``profile`` into chains; bad names or missing measurements are errors that say why.

    ``count_request=False`` holds the request at the root's input at 0 bytes: its caller
    allocated it before the plan was chosen and holds it throughout, which is how the executor
    counts (plan tables are solved so; a direct ``solve`` counts it).
    """
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    B = profile.batch_max
    named = {name for layer in iter_layers(profile.root) for name, _ in layer.runtimes}
    kinds = tuple(r for r in rt.RUNTIMES if r in named)
    choice = str(profile.meta.get("runtime", ""))
    calls = {r: cost for r in kinds if (cost := call_cost(profile, r)) is not None}
    for r, cost in calls.items():
        if len(cost.call_s) != B or len(cost.byte_s) != B or len(cost.host_s) not in (0, B):
            raise ProfileError(f"meta.runtimes.{r}: call_s and byte_s (and host_s where "
                               f"given) need {B} values each (b = 1..batch_max)")
    # units run in calls of runs on the runtime that runs them so (ONNX Runtime, CUDA
    # graphs); the energy objective has no figure for a call
    grouping = rt.grouping(kinds) if objective == "time" else ""
    run_memory = {key: ws for r in kinds for key, ws in measured_runs(profile, r).items()
                  if len(ws) == B}
    index = TreeIndex.of(profile.root)
    runs = _Runs(index, Pricing(index, calls, objective), grouping, profile.granule, run_memory,
                 B) if grouping else None
    whole_blocks = bool(profile.meta.get("lean")) and choice != rt.TORCH
    flat = _Flattener(B, objective, kinds, choice, count_request, runs, whole_blocks)
    flat.chain(profile.root, is_branch=False, parent=None)
    chains = tuple(c for c in flat.chains if c is not None)
    if not chains[0].units:
        raise ProfileError("the profile's root has no units")
    return Instance(batch_max=B, objective=objective, chains=chains,
                    fingerprint=profile.fingerprint or content_fingerprint(profile),
                    locate=flat.locate, tree=profile.root,
                    granule=profile.granule, runtimes=kinds, runtime_choice=choice, calls=calls,
                    run_memory=run_memory, grouping=grouping, whole_blocks=whole_blocks,
                    spans_held_inside=runs.spans_held_inside if runs is not None else {})


class _Flattener:
    """A profile's tree as chains, ids in the order met (a parent before its branches)."""

    def __init__(self, B: int, objective: str, kinds: tuple[str, ...], choice: str,
                 count_request: bool, runs: _Runs | None, whole_blocks: bool = False) -> None:
        self.B, self.objective, self.kinds, self.choice = B, objective, kinds, choice
        self.whole_blocks = whole_blocks
        self.count_request = count_request
        self.runs = runs
        self.chains: list[Chain | None] = []
        self.locate: dict[str, tuple[int, int]] = {}

    def unit(self, m: Layer) -> Unit:
        """A layer as a unit: its times and workspaces on the executor's own runtime."""
        B = self.B
        if len(m.ws) != B or len(m.time) != B:
            raise ProfileError(f"layer {m.name!r} needs 'time' and 'ws' for b = 1..{B}; "
                               f"this tree is not measured (run `vbs profile`)")
        _costs(m.time, "time", m.name, B, optional=False)
        if self.kinds:  # a step of the executor's own runs on torch
            time = tuple(float(unit_figures(m, rt.TORCH, b)[0]) for b in range(1, B + 1))
            ws = tuple(int(unit_figures(m, rt.TORCH, b)[1]) for b in range(1, B + 1))
        else:
            time, ws = tuple(float(t) for t in m.time), tuple(int(w) for w in m.ws)
        cost = time if self.objective == "time" else _costs(m.energy, "energy", m.name, B,
                                                            optional=False)
        if self.kinds and self.choice in self.kinds and self.choice != rt.TORCH \
                and supports(m, self.choice):
            cost = (math.inf,) * B  # --runtime onnxruntime: on it wherever it takes the unit
        return Unit(m.name, False, cost, time, ws)

    def block(self, m: Parallel, cid: int, pos: int) -> Unit:
        """A parallel block as a unit whose branches are chains of their own."""
        time = _costs(m.time, "time", m.name, self.B, optional=True)
        cost = time if self.objective == "time" else _costs(m.energy, "energy", m.name, self.B,
                                                            optional=True)
        if self.whole_blocks and self.choice in self.kinds and supports(m, self.choice):
            # the worker without torch folds no join: a block its runtime takes runs whole
            # inside one of its runs, never as branches the executor folds into the join
            cost = (math.inf,) * self.B
        branches = tuple(self.chain(b, is_branch=True, parent=(cid, pos, a))
                         for a, b in enumerate(m.branches))
        return Unit(m.name, True, cost, time, (0,) * self.B, branches, m.join)

    def chain(self, node: Node, *, is_branch: bool, parent: tuple[int, int, int] | None) -> Chain:
        """The chain of a series (the root, or a block's branch), its blocks' branches first."""
        cid = len(self.chains)
        self.chains.append(None)  # reserve the id so a parent's id is smaller than its branches'
        members = _flatten(node)
        units: list[Unit] = []
        for pos, m in enumerate(members):
            if m.name in self.locate:
                raise ProfileError(f"unit name {m.name!r} is used twice (layers and parallel blocks "
                                   f"share one namespace in a program); give every node a unique name")
            self.locate[m.name] = (cid, pos)
            units.append(self.unit(m) if isinstance(m, Layer) else self.block(m, cid, pos))
        sizes = [members[0].in_bytes] + [m.out_bytes for m in members] if units else [0]
        if not is_branch and not self.count_request:
            sizes[0] = 0
        if is_branch:
            _as_branch(units, sizes, members)
        chain = Chain(cid, tuple(units), tuple(int(s) for s in sizes), parent, tuple(members))
        if self.runs is not None:
            chain = replace(chain, runs=self.runs.table(chain))
        self.chains[cid] = chain
        return chain


def _as_branch(units: list[Unit], sizes: list[int], members: Sequence[Node]) -> None:
    """A branch's chain as the block holds it: the fork is held by the block (the paper's
    collapse), so the branch reads it at no cost of its own; its last layer's output is folded
    into the join buffer at once, so it is not held after its step, but torch allocates it
    before the fold, so it counts while the layer runs (the paper counts it as 0, which no
    executor can do). A block that closes a branch keeps its join size: its join buffer is
    allocated while its phase is open (and, conservatively, counted until the branch ends)."""
    sizes[0] = 0
    if units and not units[-1].is_block:
        out = members[-1].out_bytes
        units[-1] = replace(units[-1], ws=tuple(w + out * b for b, w in
                                                enumerate(units[-1].ws, start=1)))
        sizes[-1] = 0


@dataclass(frozen=True)
class _Runs:
    """Builds chains' run tables: every span a runtime runs as one call, priced and sized at
    every batch size (consecutive children of one series, each of which it takes)."""

    index: TreeIndex
    pricing: Pricing
    runtime: str
    granule: int
    measured: RunMemory
    batch_max: int
    spans_held_inside: RunMemory = field(default_factory=dict)  # filled as tables are built

    def table(self, chain: Chain) -> RunTable:
        spans: dict[tuple[int, int], tuple[tuple[float, ...], tuple[int, ...]]] = {}
        where = self.index.where
        nodes = chain.nodes
        batches = range(1, self.batch_max + 1)
        for i, first in enumerate(nodes):
            series, start = where[first.name]
            for j in range(i, len(nodes)):
                node = nodes[j]
                at = where[node.name]
                if at[0] is not series or at[1] != start + j - i or not supports(node, self.runtime):
                    break
                span = nodes[i:j + 1]
                inner = tuple(held_inside(span, b, self.runtime, self.granule, self.measured)
                              for b in batches)
                self.spans_held_inside[first.name, node.name] = inner
                spans[i, j] = (
                    tuple(self.pricing.run(span, self.runtime, b) for b in batches),
                    tuple(run_peak(span, b, self.runtime, chain.sizes[i] * b, self.granule,
                                   self.spans_held_inside) for b in batches))
        return RunTable(self.runtime, spans)


def content_fingerprint(profile: Profile) -> str:
    """A hash of the tree and its measurements, for profiles whose meta carries no fingerprint."""
    canon = json.dumps(node_to_json(profile.root), sort_keys=True, separators=(",", ":"))
    return "content-" + hashlib.sha256(f"{profile.batch_max}:{canon}".encode()).hexdigest()[:16]


def check_batch(instance: Instance, r: int) -> int:
    """``r`` as a request size 1..batch_max, or a UsageError."""
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= instance.batch_max:
        raise UsageError(f"request size {r!r} is outside 1..{instance.batch_max} (the profile's "
                         f"batch_max); profile with a larger batch_max to plan more samples")
    return r
