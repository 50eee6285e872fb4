"""The paper's two baselines (section IV) under the same models of memory and time as the DP.

- ``fbs`` (Fixed Batch Size): the largest uniform batch c that fits; phases of c samples run
  through the whole network one after another (the last phase takes what is left).
- ``fbs-best``: the uniform batch c that is cheapest by the profile among those that fit (what
  a user who tunes max_batch_size gets; on hardware where a larger batch is not faster per
  sample it is not the largest). Headline gains are stated against it.
- ``greedy`` (Greedy-VBS): layer after layer over all r samples; each layer takes the largest
  batch that fits with all r samples held at its input and at its output (a block opens one
  phase of all r samples, its fork and join held for all r, and its branches' layers are
  chosen the same way inside).

How the steps run is an ``Assignment``: on the profile's only kernels (a profile that names
no runtime), all on torch, or in runs (where a runtime runs units in calls, every longest
span it takes is one call per phase, as a user runs the whole model in ONNX Runtime; the
rest on torch). A baseline takes the cheapest assignment the runtime choice allows that fits.

"Fits" is judged in slots exactly as the DP solvers count the same program (every piece
rounded up: ``fbs_slots``, ``greedy_units``), so at every budget ``vbs`` is at least as good
as both baselines (their programs are in its search space with the same accounting), and
every baseline plan's exact peak is within the budget. Exact peaks are computed here in
closed form, independently of the simulator, which the tests compare them with. Programs
are priced by ``planner.solver.pricing`` with their runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core import runtimes as rt
from core.errors import InfeasibleError
from core.sizes import slots_up
from planner.solver.model import Chain, Instance
from core.program import Step

Assignment = str  # "" (the profile's only kernels), "torch", or "runs"
Program = tuple[tuple[Step, ...], tuple[tuple[int, int], ...]]  # steps, runs


def assignments(inst: Instance) -> tuple[Assignment, ...]:
    """The ways a baseline's steps may run for this instance's runtime choice."""
    if not inst.runtimes:
        return ("",)
    if not inst.grouping:
        return (rt.TORCH,)
    return ("runs",) if inst.runtime_choice == inst.grouping else ("runs", rt.TORCH)


def _segments(chain: Chain, a: Assignment) -> list[tuple[int, int]]:
    """The chain cut into what one phase runs: (i, j) spans run as one call (i <= j) or single
    steps (i, -1)."""
    spans = chain.runs.spans if chain.runs is not None and a == "runs" else {}
    out: list[tuple[int, int]] = []
    i = 0
    while i < chain.n:
        j = max((j for j in range(i, chain.n) if (i, j) in spans), default=-1)
        out.append((i, j))
        i = max(i, j) + 1
    return out


def _run(chain: Chain, i: int, j: int, p: int) -> tuple[float, int]:
    assert chain.runs is not None
    cost, need = chain.runs.spans[i, j]
    return cost[p - 1], need[p - 1]


def _step_bytes(chain: Chain, k: int, p: int) -> int:
    """What a layer's own step (not a run) needs at p samples: its input, workspace, output."""
    return chain.sizes[k] * p + chain.units[k].ws_at(p) + chain.sizes[k + 1] * p


# --------------------------------------------------------------------------- FBS


def uniform_peak(chain: Chain, p: int, a: Assignment = "") -> int:
    """Exact peak of one uniform phase of p samples through ``chain``, from nothing held."""
    peak = 0
    for i, j in _segments(chain, a):
        u = chain.units[i]
        if j >= 0:
            need = _run(chain, i, j, p)[1]
        elif u.is_block:
            need = (chain.sizes[i] + chain.sizes[i + 1]) * p + max(
                (uniform_peak(br, p, a) for br in u.branches), default=0)
        else:
            need = _step_bytes(chain, i, p)
        peak = max(peak, need)
    return peak


def uniform_slots(chain: Chain, p: int, slot: int, a: Assignment = "") -> int:
    """Slots the DP counts for one uniform phase of p samples (each piece rounded up)."""
    worst = 0
    for i, j in _segments(chain, a):
        u = chain.units[i]
        if j >= 0:
            need = slots_up(_run(chain, i, j, p)[1], slot)
        elif u.is_block:
            need = slots_up((chain.sizes[i] + chain.sizes[i + 1]) * p, slot) + max(
                (uniform_slots(br, p, slot, a) for br in u.branches), default=0)
        else:
            need = slots_up(_step_bytes(chain, i, p), slot)
        worst = max(worst, need)
    return worst


def _uniform_phase(inst: Instance, chain: Chain, p: int, a: Assignment, steps: list[Step],
                   runs: list[tuple[int, int]]) -> None:
    """Every unit of ``chain`` once at p samples (a block: its phase, then its branches)."""
    own = a if a != "runs" else rt.TORCH
    for i, j in _segments(chain, a):
        if j >= 0:
            start = len(steps)
            for u in chain.units[i:j + 1]:
                _uniform_phase_whole(u, p, inst.grouping, steps)
            runs.append((start, len(steps) - 1))
            continue
        u = chain.units[i]
        steps.append(Step(u.name, p, own))
        for br in u.branches:
            _uniform_phase(inst, br, p, a, steps, runs)


def _uniform_phase_whole(u, p: int, runtime: str, steps: list[Step]) -> None:  # type: ignore[no-untyped-def]
    steps.append(Step(u.name, p, runtime))
    for br in u.branches:  # in fold order: only identity branches (no units) move
        for v in br.units:
            _uniform_phase_whole(v, p, runtime, steps)


def fbs_phases(c: int, r: int) -> list[int]:
    """Phase sizes of FBS with batch c over r samples: c, c, ..., then what is left."""
    return [c] * (r // c) + ([r % c] if r % c else [])


def fbs_peak(inst: Instance, c: int, r: int, a: Assignment = "") -> int:
    """Exact peak of FBS at batch c over r samples (waiting inputs and finished outputs held)."""
    root = inst.root
    peak, done = 0, 0
    for p in fbs_phases(c, r):
        held = root.sizes[0] * (r - done - p) + root.sizes[-1] * done
        peak = max(peak, held + uniform_peak(root, p, a))
        done += p
    return peak


def fbs_slots(inst: Instance, c: int, r: int, slot: int, a: Assignment = "") -> int:
    """Slots FBS at batch c needs in the DP's accounting: per phase, the waiting inputs (one
    piece), each earlier phase's outputs (one piece each) and the phase itself."""
    root = inst.root
    worst, done, outputs = 0, 0, 0
    for p in fbs_phases(c, r):
        waiting = slots_up(root.sizes[0] * (r - done - p), slot)
        worst = max(worst, waiting + outputs + uniform_slots(root, p, slot, a))
        outputs += slots_up(root.sizes[-1] * p, slot)
        done += p
    return worst


def fbs_program(inst: Instance, c: int, r: int, a: Assignment = "") -> Program:
    steps: list[Step] = []
    runs: list[tuple[int, int]] = []
    for p in fbs_phases(c, r):
        _uniform_phase(inst, inst.root, p, a, steps, runs)
    return tuple(steps), tuple(runs)


def program_cost(inst: Instance, program: Program) -> float:
    """The objective's total of a program with its runs."""
    return inst.pricing.program(*program)


def fbs_cost(inst: Instance, c: int, r: int, a: Assignment = "") -> float:
    """The objective's total for r samples in uniform batches of c."""
    return program_cost(inst, fbs_program(inst, c, r, a))


def fbs_choice(inst: Instance, r: int, slots: int, slot: int, *, best: bool
               ) -> tuple[int, Assignment] | None:
    """fbs: the largest uniform batch that fits in ``slots`` (its cheapest fitting
    assignment); ``best`` (fbs-best): the cheapest batch and assignment that fit (the larger
    batch on a tie). None when even batch 1 does not fit."""
    found: tuple[float, int, Assignment] | None = None
    for c in range(r, 0, -1):
        for a in assignments(inst):
            if fbs_slots(inst, c, r, slot, a) <= slots:
                cost = fbs_cost(inst, c, r, a)
                if found is None or cost < found[0] and (best or found[1] == c):
                    found = (cost, c, a)
        if found is not None and not best:
            break
    return None if found is None else (found[1], found[2])


# --------------------------------------------------------------------------- Greedy-VBS


@dataclass(frozen=True)
class GreedyUnit:
    """One unit's greedy choice: the slots it needs at each batch size, and what it runs on."""

    name: str
    is_block: bool
    need_by_batch: tuple[int, ...]  # index c-1: slots needed to run the unit at batch c
    runtime: str = ""  # its steps' runtime; a step on the runtime that runs units in calls is
    in_run: bool = False  # a run of one


def _batched_slots(s_in: int, s_out: int, step: Callable[[int], int], c: int, r: int,
                   slot: int) -> int:
    """Slots the DP counts for one unit run over r samples in batches of c (``step(p)``: the
    bytes one step of p samples needs with its input and output)."""
    worst, done, outputs = 0, 0, 0
    for p in fbs_phases(c, r):
        waiting = slots_up(s_in * (r - done - p), slot)
        worst = max(worst, waiting + outputs + slots_up(step(p), slot))
        outputs += slots_up(s_out * p, slot)
        done += p
    return worst


def _greedy_step(chain: Chain, k: int, a: Assignment) -> tuple[Callable[[int], int], bool]:
    """What one step of unit k needs at p samples, and whether it is a run of one."""
    if a == "runs" and chain.runs is not None and (k, k) in chain.runs.spans \
            and not chain.units[k].is_block:
        return (lambda p: _run(chain, k, k, p)[1]), True
    return (lambda p: _step_bytes(chain, k, p)), False


def greedy_units(inst: Instance, r: int, slot: int, a: Assignment = "") -> list[GreedyUnit]:
    """Every unit in program order with the slots Greedy-VBS needs to run it at each batch.

    The paper's rule: a layer at batch c needs its inputs and outputs for all r samples held,
    ``in*r + out*r + ws`` (for c and for the last, smaller batch), on top of what enclosing
    block phases hold; and, as for every solver, its sub-batched run must fit in the DP's
    slot accounting. A block needs ``(in+out)*r`` to open its phase of all r samples.
    """
    out: list[GreedyUnit] = []
    own = a if a != "runs" else rt.TORCH

    def walk(chain: Chain, held: int) -> None:
        for k, u in enumerate(chain.units):
            s_in, s_out = chain.sizes[k], chain.sizes[k + 1]
            if u.is_block:
                need = held + slots_up((s_in + s_out) * r, slot)
                out.append(GreedyUnit(u.name, True, (need,) * r, own))
                for br in u.branches:
                    walk(br, need)
                continue
            step, in_run = _greedy_step(chain, k, a)
            def extra(p: int) -> int:  # the step's own need beyond its input and output
                return step(p) - (s_in + s_out) * p  # noqa: B023 (used in this iteration)

            needs = []
            for c in range(1, r + 1):
                ws = max(extra(c), extra(r % c) if r % c else 0)
                rule = slots_up(s_in * r + ws + s_out * r, slot)
                needs.append(held + max(rule, _batched_slots(s_in, s_out, step, c, r, slot)))
            out.append(GreedyUnit(u.name, False, tuple(needs),
                                  inst.grouping if in_run else own, in_run))

    walk(inst.root, 0)
    return out


def greedy_choice(units: list[GreedyUnit], slots: int) -> tuple[int, ...] | None:
    """Per unit the largest batch that fits in ``slots``; None if some unit fits none."""
    choice = []
    for gu in units:
        best = 0
        for c in range(len(gu.need_by_batch), 0, -1):
            if gu.need_by_batch[c - 1] <= slots:
                best = c
                break
        if best == 0:
            return None
        choice.append(len(gu.need_by_batch) if gu.is_block else best)
    return tuple(choice)


def greedy_program(units: list[GreedyUnit], choice: tuple[int, ...], r: int) -> Program:
    steps: list[Step] = []
    runs: list[tuple[int, int]] = []
    for gu, c in zip(units, choice):
        for p in ((r,) if gu.is_block else fbs_phases(c, r)):
            if gu.in_run:
                runs.append((len(steps), len(steps)))
            steps.append(Step(gu.name, p, gu.runtime))
    return tuple(steps), tuple(runs)


def greedy_peak(inst: Instance, units: list[GreedyUnit], choice: tuple[int, ...], r: int) -> int:
    """Exact peak of a greedy program: each step's held inputs, outputs and workspace."""
    peak = 0
    it = iter(zip(units, choice))

    def walk(chain: Chain, held: int) -> None:
        nonlocal peak
        for k, u in enumerate(chain.units):
            s_in, s_out = chain.sizes[k], chain.sizes[k + 1]
            gu, c = next(it)
            if u.is_block:
                need = held + (s_in + s_out) * r
                peak = max(peak, need)
                for br in u.branches:
                    walk(br, need)
                continue
            step = ((lambda p: _run(chain, k, k, p)[1]) if gu.in_run
                    else (lambda p: _step_bytes(chain, k, p)))
            done = 0
            for p in fbs_phases(c, r):
                need = held + s_in * (r - done - p) + s_out * done + step(p)
                peak = max(peak, need)
                done += p

    walk(inst.root, 0)
    return peak


def greedy_best(inst: Instance, r: int, slots: int, slot: int
                ) -> tuple[list[GreedyUnit], tuple[int, ...]] | None:
    """Greedy's units and choice within ``slots`` on the cheapest assignment that fits."""
    found = None
    for a in assignments(inst):
        units = greedy_units(inst, r, slot, a)
        choice = greedy_choice(units, slots)
        if choice is not None:
            cost = program_cost(inst, greedy_program(units, choice, r))
            if found is None or cost < found[0]:
                found = (cost, units, choice)
    return None if found is None else (found[1], found[2])


def least_greedy_bytes(inst: Instance, r: int, slot: int) -> int:
    """The least memory any greedy program of r samples needs (bytes of whole slots)."""
    return min(max(gu.need_by_batch[0] for gu in greedy_units(inst, r, slot, a))
               for a in assignments(inst)) * slot


def infeasible(what: str, r: int, budget: int, usable: int, least: int | None) -> InfeasibleError:
    more = (f"; it needs at least {least} bytes ({least - budget} more)" if least is not None
            else "")
    return InfeasibleError(f"{what} has no schedule of {r} samples within {budget} bytes "
                           f"(usable {usable}){more}: give more memory or a smaller request")


def least_fbs_bytes(inst: Instance, r: int, slot: int) -> int:
    """The least memory any fbs program of r samples needs (bytes of whole slots)."""
    return min(fbs_slots(inst, 1, r, slot, a) for a in assignments(inst)) * slot

