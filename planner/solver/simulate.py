"""The simulator: the one executable statement of what a Program means under the model of memory.

Every solver's claims are checked against it and the executor must do exactly what it does.

State: samples wait at boundaries; the root chain starts with the request's r samples at its
input and ends with all r at its output. Held memory is, over every boundary of every active
chain, (samples waiting there) x (bytes per sample there), plus the join buffer of every open
block phase. Samples are first in, first out at every boundary.

Steps, in order, each ``{"unit": U, "samples": C}`` with C >= 1:

- A layer takes the next C samples at its input; while it runs it needs
  ``held + ws(U, C) + out(U) * C`` (its inputs are still held; ws is that of the runtime the
  step runs on); then they are released and C samples wait at its output.
- A parallel block opens a phase of C samples: they stay held at its input (the fork) until
  the phase closes, and its join buffer, ``out(U) * C``, is reserved; it costs the block's fold
  cost. Its branches' steps follow, in the branches' order: each branch is a chain that starts
  with the C fork samples and ends with all C folded into the join (its ends hold 0 bytes:
  the fork and the join are the block's). An identity branch has no steps. When the last
  branch is done the fork is released and the join's C samples wait at the block's output.
  While a phase is open only steps of its current branch are allowed.
- A run (``runs``: first and last step) is one call of a runtime: its steps are the units
  of consecutive children of one series at one batch size C, blocks whole (a block's step,
  then its branches' units once each), taking the next C samples at its input while nothing
  waits between its units; while it runs it needs ``held + run_peak`` (what the runtime
  holds inside and the run's output, ``core.runs``), for every one of its steps.

A program costs what ``planner.solver.pricing`` says it costs with those runs.

A program is refused (InvalidProgramError naming the step and why) for an unknown unit, C < 1,
more samples than wait, a step outside the open phase's current branch, a step over budget, or
samples left anywhere but the root output. Budget: with ``slot_bytes`` s the usable budget is
``floor(budget / s) * s``, and the slot-rounded peak reported is ``ceil(peak / s) * s``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from core.errors import InvalidProgramError, UsageError
from core.sizes import check_slot_bytes
from planner.solver.model import Chain, Instance, build_instance
from core.program import Program, Step
from core.runs import run_peak, run_runtime, step_runtime, unit_figures
from core.tree import Node, Parallel, Profile, fold_order


@dataclass(frozen=True)
class UnitUsage:
    """What one unit did: the batch size of each of its steps and the memory left unused then."""

    name: str
    batches: tuple[int, ...]
    unused_bytes: tuple[int, ...]  # budget minus the need while that step ran (Table III)


@dataclass(frozen=True)
class Simulation:
    """The replay of a program: its cost, time and peak memory, per step and per unit."""

    batch: int
    budget_bytes: int
    slot_bytes: int
    usable_bytes: int        # budget rounded down to whole slots
    cost: float              # total objective
    time_total: float        # total seconds
    modelled_bytes: int      # exact peak under the model of memory (the walk's is ``peak_bytes``)
    peak_slot_bytes: int     # peak rounded up to whole slots
    step_need_bytes: tuple[int, ...]
    units: tuple[UnitUsage, ...] = field(default_factory=tuple)

    @property
    def time_per_sample(self) -> float:
        return self.time_total / self.batch

    def usage(self, name: str) -> UnitUsage:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)


@dataclass
class _Frame:
    """One active chain: samples waiting at its boundaries, and the block phase it has open."""

    chain: Chain
    counts: list[int]
    target: int                   # samples this chain must move to its output
    open_pos: int = -1            # position of the block whose phase is open, -1 for none
    open_samples: int = 0
    open_branch: int = 0

    def held(self) -> int:
        total = sum(c * s for c, s in zip(self.counts, self.chain.sizes))
        if self.open_pos >= 0:  # the join buffer of the open phase
            total += self.chain.sizes[self.open_pos + 1] * self.open_samples
        return total


def _as_steps(program: Program | Iterable[Step] | list) -> tuple[Step, ...]:
    if isinstance(program, Program):
        return program.steps
    if isinstance(program, list) and program and isinstance(program[0], dict):
        return Program.from_json(program).steps
    return tuple(program)


def simulate(model: Profile | Instance, program: Program | Iterable[Step], batch: int,
             budget_bytes: int, *, slot_bytes: int = 1, objective: str = "time",
             runs: Iterable[tuple[int, int]] = ()) -> Simulation:
    """Replay ``program`` (with its ``runs``) on ``batch`` samples within ``budget_bytes``;
    raise if it is invalid."""
    inst = model if isinstance(model, Instance) else build_instance(model, objective)
    _check_request(inst, batch, budget_bytes, slot_bytes)
    usable = budget_bytes // slot_bytes * slot_bytes
    steps = _as_steps(program)
    runs = tuple(runs)
    run_end = _check_runs(inst, steps, runs)

    root = inst.root
    stack = [_Frame(root, [batch] + [0] * root.n, batch)]
    needs: list[int] = []
    in_run = -1  # the last step of the run being replayed (-1: none)
    run_peak_now = 0
    per_unit: dict[str, tuple[list[int], list[int]]] = {n: ([], []) for n in inst.unit_names}

    for i, step in enumerate(steps):
        pos = _check_step(inst, stack, i, step)
        top = stack[-1]
        unit = top.chain.units[pos]
        c = step.samples
        held = sum(f.held() for f in stack)
        node = top.chain.nodes[pos]
        if i in run_end:  # a run starts: one need for all its steps
            end = run_end[i]
            nodes = inst.index.run_nodes(steps, i, end)
            if any(top.counts[pos + 1:pos + len(nodes)]):
                raise InvalidProgramError(f"{_where(i, step)}: a run starts while samples wait "
                                          "between its units")
            in_run, run_peak_now = end, held + run_peak(nodes, c, run_runtime(nodes[0], step), 0,
                                                        inst.granule, inst.run_memory)
        if in_run >= i:
            need = run_peak_now
        elif unit.is_block:
            need = held + top.chain.sizes[pos + 1] * c
        else:
            runtime = step_runtime(node, step)
            need = held + node.out_bytes * c + unit_figures(node, runtime, c)[1]  # type: ignore[arg-type]
        if need > usable:
            rounded = f" ({budget_bytes} rounded down to slots of {slot_bytes})" if usable != budget_bytes else ""
            raise InvalidProgramError(f"{_where(i, step)}: needs {need} bytes but the budget "
                                      f"allows {usable}{rounded}; {need - usable} bytes over")
        needs.append(need)
        per_unit[unit.name][0].append(c)
        per_unit[unit.name][1].append(budget_bytes - need)
        if unit.is_block:
            top.open_pos, top.open_samples, top.open_branch = pos, c, 0
            _enter_branch(stack)
        else:
            top.counts[pos] -= c
            top.counts[pos + 1] += c
        _close_finished(stack)

    if len(stack) > 1 or stack[0].counts[-1] != batch:
        raise InvalidProgramError(f"the program ends with samples unprocessed: {_leftover(stack)}")
    peak = max(needs, default=0)
    return Simulation(
        batch=batch, budget_bytes=budget_bytes, slot_bytes=slot_bytes, usable_bytes=usable,
        cost=inst.pricing.program(steps, runs), time_total=inst.time_pricing.program(steps, runs),
        modelled_bytes=peak,
        peak_slot_bytes=-(-peak // slot_bytes) * slot_bytes, step_need_bytes=tuple(needs),
        units=tuple(UnitUsage(n, tuple(b), tuple(u)) for n, (b, u) in per_unit.items()))


def _check_request(inst: Instance, batch: int, budget_bytes: int, slot_bytes: int) -> None:
    """The request and the budget as ``simulate`` takes them, else a UsageError saying why."""
    check_slot_bytes(slot_bytes)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise UsageError(f"request size must be a whole number >= 1, got {batch!r}")
    if batch > inst.batch_max:
        raise UsageError(f"request size {batch} is larger than the profile's batch_max {inst.batch_max}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise UsageError(f"memory budget must be a whole number of bytes >= 0, got {budget_bytes!r}")


def _where(i: int, step: Step) -> str:
    return f"step {i} ({step.unit!r} x {step.samples})"


def _check_step(inst: Instance, stack: list[_Frame], i: int, step: Step) -> int:
    """Step i's position in the chain running now, after checking it may run there."""
    if step.unit not in inst.locate:
        raise InvalidProgramError(f"{_where(i, step)}: no unit of that name in the profile")
    if isinstance(step.samples, bool) or not isinstance(step.samples, int) or step.samples < 1:
        raise InvalidProgramError(f"{_where(i, step)}: samples must be a whole number >= 1")
    cid, pos = inst.locate[step.unit]
    top = stack[-1]
    if cid != top.chain.cid:
        raise InvalidProgramError(f"{_where(i, step)}: {_out_of_order(inst, stack, cid)}")
    waiting = top.counts[pos]
    if step.samples > waiting:
        raise InvalidProgramError(f"{_where(i, step)}: only {waiting} samples wait at the input "
                                  f"of {top.chain.units[pos].name!r}")
    return pos


def _check_runs(inst: Instance, steps: tuple[Step, ...], runs: tuple[tuple[int, int], ...]
                ) -> dict[int, int]:
    """First step -> last step of every run, after checking that each run's steps are the
    units of consecutive children of one series at one batch size, blocks whole."""
    out: dict[int, int] = {}
    last = -1
    for start, end in runs:
        if not last < start <= end < len(steps):
            raise InvalidProgramError(f"run ({start}, {end}): runs must be ordered, disjoint "
                                      f"[first, last] steps of the program's {len(steps)}")
        for k in (start, end):
            if steps[k].unit not in inst.locate:
                raise InvalidProgramError(f"run ({start}, {end}): no unit {steps[k].unit!r}")
        nodes = inst.index.run_nodes(steps, start, end)
        want = [name for node in nodes for name in _whole_names(node)]
        got = [s.unit for s in steps[start:end + 1]]
        if got != want or any(s.samples != steps[start].samples for s in steps[start:end + 1]):
            raise InvalidProgramError(
                f"run ({start}, {end}): its steps must run {', '.join(want)} once each at one "
                f"batch size (consecutive children of one series, blocks whole), got {got}")
        out[start] = end
        last = end
    return out


def _whole_names(node: Node) -> list[str]:
    """A node's steps when it runs whole: itself, and a block's branch units in fold order."""
    names = [node.name]
    if isinstance(node, Parallel):
        for b in fold_order(node):
            for child in node.branches[b].children:
                names.extend(_whole_names(child))
    return names


def _enter_branch(stack: list[_Frame]) -> None:
    """Push the open phase's current branch, skipping empty ones (they have no steps)."""
    top = stack[-1]
    block = top.chain.units[top.open_pos]
    while top.open_branch < len(block.branches) and block.branches[top.open_branch].n == 0:
        top.open_branch += 1
    if top.open_branch < len(block.branches):
        branch = block.branches[top.open_branch]
        stack.append(_Frame(branch, [top.open_samples] + [0] * branch.n, top.open_samples))


def _close_finished(stack: list[_Frame]) -> None:
    """Pop every finished branch; close a phase when its last branch is done."""
    while True:
        top = stack[-1]
        if top.open_pos >= 0:
            block = top.chain.units[top.open_pos]
            if top.open_branch >= len(block.branches):  # every branch done: the phase closes
                top.counts[top.open_pos] -= top.open_samples
                top.counts[top.open_pos + 1] += top.open_samples
                top.open_pos, top.open_samples, top.open_branch = -1, 0, 0
                continue
            return
        if len(stack) > 1 and top.counts[-1] == top.target:  # a branch moved all its samples
            stack.pop()
            parent = stack[-1]
            parent.open_branch += 1
            _enter_branch(stack)
            continue
        return


def _chain_label(inst: Instance, cid: int) -> str:
    chain = inst.chains[cid]
    if chain.parent is None:
        return "the main chain"
    pcid, pos, a = chain.parent
    return f"branch {a} of block {inst.chains[pcid].units[pos].name!r}"


def _out_of_order(inst: Instance, stack: list[_Frame], cid: int) -> str:
    """Why a unit of chain ``cid`` cannot run now, in words."""
    active = {f.chain.cid: f for f in stack}
    top = stack[-1]
    if cid in active:  # an enclosing chain: a phase is open below it
        f = active[cid]
        block = f.chain.units[f.open_pos]
        return (f"block {block.name!r} has a phase of {f.open_samples} samples open; it must "
                f"close first ({_chain_label(inst, top.chain.cid)} has "
                f"{top.target - top.counts[-1]} samples still to process)")
    # the unit is inside some block: find the block that encloses it
    pcid, pos, a = inst.chains[cid].parent  # type: ignore[misc]
    block = inst.chains[pcid].units[pos]
    if pcid in active and active[pcid].open_pos == pos:
        f = active[pcid]
        if a < f.open_branch:
            return (f"branch {a} of block {block.name!r} has already processed all "
                    f"{f.open_samples} samples of this phase")
        return (f"branches of block {block.name!r} run in order: branch {f.open_branch} has "
                f"{top.target - top.counts[-1]} of {f.open_samples} samples still to process "
                f"before branch {a} may start")
    return (f"the unit is inside {_chain_label(inst, cid)}, which has no phase open; open one "
            f"with a step {{'unit': {block.name!r}, 'samples': C}} first")


def _leftover(stack: list[_Frame]) -> str:
    parts = []
    for f in stack:
        for k, c in enumerate(f.counts[:-1]):
            if c:
                parts.append(f"{c} wait before {f.chain.units[k].name!r}")
        if f.open_pos >= 0:
            parts.append(f"block {f.chain.units[f.open_pos].name!r} has a phase of "
                         f"{f.open_samples} open")
        if len(stack) > 1 and f is stack[-1]:
            parts.append(f"{f.target - f.counts[-1]} not yet through the current branch")
    return "; ".join(parts) or "nothing reached the output"
