"""The paper's two baselines (section IV) under the same model of memory as the DP solvers.

- ``fbs`` (Fixed Batch Size): the largest uniform batch c that fits; phases of c samples run
  through the whole network one after another (the last phase takes what is left).
- ``fbs-best``: the uniform batch c that is fastest by the profile among those that fit (what
  a user who tunes max_batch_size gets; on hardware where a larger batch is not faster per
  sample it is not the largest). Headline gains are stated against it.
- ``greedy`` (Greedy-VBS): layer after layer over all r samples; each layer takes the largest
  batch that fits with all r samples held at its input and at its output (a block opens one
  phase of all r samples, its fork and join held for all r, and its branches' layers are
  chosen the same way inside).

"Fits" is judged in slots exactly as the DP solvers count the same program (every piece
rounded up: ``fbs_slots``, ``greedy_units``), so at every budget ``vbs`` is at least as good
as both baselines (their programs are in its search space with the same accounting), and
every baseline plan's exact peak is within the budget. Exact peaks are computed here in
closed form, independently of the simulator, which the tests compare them with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import InfeasibleError
from planner.solver.memory import slots_up
from planner.solver.model import Chain, Instance

# --------------------------------------------------------------------------- shared


def program_costs(inst: Instance, pairs: list[tuple[str, int]]) -> tuple[float, float]:
    """(total objective cost, total seconds) of a program given as (unit, samples) pairs."""
    units = [(inst.unit(u), c) for u, c in pairs]
    return (math.fsum(u.cost_at(c) for u, c in units), math.fsum(u.time_at(c) for u, c in units))


# --------------------------------------------------------------------------- FBS


def _uniform_phase(chain: Chain, p: int, out: list[tuple[str, int]]) -> None:
    """Every unit of ``chain`` once at p samples (a block: its phase, then its branches)."""
    for u in chain.units:
        out.append((u.name, p))
        for br in u.branches:
            _uniform_phase(br, p, out)


def uniform_peak(chain: Chain, p: int) -> int:
    """Exact peak of one uniform phase of p samples through ``chain``, from nothing held."""
    peak = 0
    for k, u in enumerate(chain.units):
        io = (chain.sizes[k] + chain.sizes[k + 1]) * p
        if u.is_block:
            need = io + max((uniform_peak(br, p) for br in u.branches), default=0)
        else:
            need = io + u.ws_at(p)
        peak = max(peak, need)
    return peak


def fbs_phases(c: int, r: int) -> list[int]:
    """Phase sizes of FBS with batch c over r samples: c, c, ..., then what is left."""
    return [c] * (r // c) + ([r % c] if r % c else [])


def fbs_peak(inst: Instance, c: int, r: int) -> int:
    """Exact peak of FBS at batch c over r samples (waiting inputs and finished outputs held)."""
    root = inst.root
    peak, done = 0, 0
    for p in fbs_phases(c, r):
        held = root.sizes[0] * (r - done - p) + root.sizes[-1] * done
        peak = max(peak, held + uniform_peak(root, p))
        done += p
    return peak


def uniform_slots(chain: Chain, p: int, slot: int) -> int:
    """Slots the DP counts for one uniform phase of p samples (each piece rounded up)."""
    worst = 0
    for k, u in enumerate(chain.units):
        io = (chain.sizes[k] + chain.sizes[k + 1]) * p
        if u.is_block:
            need = slots_up(io, slot) + max((uniform_slots(br, p, slot) for br in u.branches), default=0)
        else:
            need = slots_up(io + u.ws_at(p), slot)
        worst = max(worst, need)
    return worst


def fbs_slots(inst: Instance, c: int, r: int, slot: int) -> int:
    """Slots FBS at batch c needs in the DP's accounting: per phase, the waiting inputs (one
    piece), each earlier phase's outputs (one piece each) and the phase itself."""
    root = inst.root
    worst, done, outputs = 0, 0, 0
    for p in fbs_phases(c, r):
        waiting = slots_up(root.sizes[0] * (r - done - p), slot)
        worst = max(worst, waiting + outputs + uniform_slots(root, p, slot))
        outputs += slots_up(root.sizes[-1] * p, slot)
        done += p
    return worst


def fbs_program(inst: Instance, c: int, r: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for p in fbs_phases(c, r):
        _uniform_phase(inst.root, p, out)
    return out


def fbs_batch(inst: Instance, r: int, slots: int, slot: int) -> int:
    """The largest uniform batch that fits in ``slots``, or 0 when even batch 1 does not."""
    for c in range(r, 0, -1):
        if fbs_slots(inst, c, r, slot) <= slots:
            return c
    return 0


def fbs_cost(inst: Instance, c: int, r: int) -> float:
    """The objective's total for r samples in uniform batches of c."""
    return program_costs(inst, fbs_program(inst, c, r))[0]


def fbs_best_batch(inst: Instance, r: int, slots: int, slot: int) -> int:
    """The uniform batch that is cheapest by the profile among those that fit in ``slots``
    (the larger on a tie), or 0 when even batch 1 does not fit."""
    best, best_cost = 0, math.inf
    for c in range(r, 0, -1):
        if fbs_slots(inst, c, r, slot) <= slots:
            cost = fbs_cost(inst, c, r)
            if cost < best_cost:
                best, best_cost = c, cost
    return best


# --------------------------------------------------------------------------- Greedy-VBS


@dataclass(frozen=True)
class GreedyUnit:
    """One unit's greedy choice: the slots it needs at each batch size."""

    name: str
    is_block: bool
    need_by_batch: tuple[int, ...]  # index c-1: slots needed to run the unit at batch c


def _batched_slots(s_in: int, s_out: int, ws: tuple[int, ...], c: int, r: int, slot: int) -> int:
    """Slots the DP counts for one unit run over r samples in batches of c."""
    worst, done, outputs = 0, 0, 0
    for p in fbs_phases(c, r):
        waiting = slots_up(s_in * (r - done - p), slot)
        worst = max(worst, waiting + outputs + slots_up(s_in * p + ws[p - 1] + s_out * p, slot))
        outputs += slots_up(s_out * p, slot)
        done += p
    return worst


def greedy_units(inst: Instance, r: int, slot: int) -> list[GreedyUnit]:
    """Every unit in program order with the slots Greedy-VBS needs to run it at each batch.

    The paper's rule: a layer at batch c needs its inputs and outputs for all r samples held,
    ``in*r + out*r + ws`` (for c and for the last, smaller batch), on top of what enclosing
    block phases hold; and, as for every solver, its sub-batched run must fit in the DP's
    slot accounting. A block needs ``(in+out)*r`` to open its phase of all r samples.
    """
    out: list[GreedyUnit] = []

    def walk(chain: Chain, held: int) -> None:
        for k, u in enumerate(chain.units):
            s_in, s_out = chain.sizes[k], chain.sizes[k + 1]
            if u.is_block:
                need = held + slots_up((s_in + s_out) * r, slot)
                out.append(GreedyUnit(u.name, True, (need,) * r))
                for br in u.branches:
                    walk(br, need)
                continue
            needs = []
            for c in range(1, r + 1):
                ws = max(u.ws_at(c), u.ws_at(r % c) if r % c else 0)
                rule = slots_up(s_in * r + ws + s_out * r, slot)
                needs.append(held + max(rule, _batched_slots(s_in, s_out, u.ws, c, r, slot)))
            out.append(GreedyUnit(u.name, False, tuple(needs)))

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


def greedy_program(units: list[GreedyUnit], choice: tuple[int, ...], r: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for gu, c in zip(units, choice):
        if gu.is_block:
            out.append((gu.name, r))
        else:
            out.extend((gu.name, p) for p in fbs_phases(c, r))
    return out


def greedy_peak(inst: Instance, choice: tuple[int, ...], r: int) -> int:
    """Exact peak of a greedy program: each step's held inputs, outputs and workspace."""
    peak = 0
    it = iter(choice)

    def walk(chain: Chain, held: int) -> None:
        nonlocal peak
        for k, u in enumerate(chain.units):
            s_in, s_out = chain.sizes[k], chain.sizes[k + 1]
            c = next(it)
            if u.is_block:
                need = held + (s_in + s_out) * r
                peak = max(peak, need)
                for br in u.branches:
                    walk(br, need)
                continue
            done = 0
            for p in fbs_phases(c, r):
                need = held + s_in * (r - done) + s_out * (done + p) + u.ws_at(p)
                peak = max(peak, need)
                done += p

    walk(inst.root, 0)
    return peak


def infeasible(what: str, r: int, budget: int, usable: int, least: int | None) -> InfeasibleError:
    more = (f"; it needs at least {least} bytes ({least - budget} more)" if least is not None
            else "")
    return InfeasibleError(f"{what} has no schedule of {r} samples within {budget} bytes "
                           f"(usable {usable}){more}: give more memory or a smaller request")
