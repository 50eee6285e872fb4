"""Run the DP kernels over a whole tree and read plans out of the result.

Chains are solved bottom-up: every branch chain of a block before the chain holding the
block, so a block's exact cost E (the paper's "special layer") is ready when its chain is
solved. All chains' tables live in one flat float64 buffer so that ``kernel.reconstruct`` can
walk from the root into branches without Python in the loop.

Memory accounting in slots (docs/architecture.md): a layer step needs
``slots_up(in*b + ws(b) + out*b)``; a block phase reserves ``slots_up((in+out)*b)`` for the
fork and the join and gives its branches the rest; a run needs ``slots_up(run_peak)``
(``core.runs``); waiting inputs and arrived outputs of a phase split are
``slots_up(size*count)`` each. Every piece is rounded up, so the exact bytes of a plan chosen
within m slots never exceed ``m * slot_bytes``.

A plan is read out as records (a unit's step, or a span of units run as one call) and
expanded here into the program's steps, each naming its runtime, and its runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core import runtimes as rt
from core.errors import PlanError, UsageError
from planner.solver import kernel
from core.sizes import slots_up
from planner.solver.model import Chain, Instance, Unit

MODES = {"vbs": kernel.MODE_VBS, "paper": kernel.MODE_PAPER}
MAX_SLOTS = 1 << 16  # beyond this the memory axis is too fine to be useful: use larger slots


@dataclass(frozen=True)
class RawPlan:
    """A program read out of the tables, as global unit indices, with its exact needs."""

    units: np.ndarray     # int64 global unit index per step
    samples: np.ndarray   # int64 samples per step
    needs: np.ndarray     # int64 exact bytes needed by each step (a run's steps: the run's)
    peak: int
    cost: float           # the DP's value of OPT[root, r, m]
    runtimes: tuple[str, ...] = ()  # per step ('' throughout for a profile that names none)
    runs: tuple[tuple[int, int], ...] = ()  # (first step, last step) of each runtime call


class ChainTables:
    """DP tables of every chain of an instance for one mode, batch sizes 0..B and slots 0..M."""

    def __init__(self, inst: Instance, mode: str, slot_bytes: int, slots: int, batch: int | None = None):
        if mode not in MODES:
            raise UsageError(f"unknown DP solver {mode!r}; use one of {', '.join(MODES)}")
        if slots < 0:
            raise UsageError(f"memory of {slots} slots is negative")
        if slots >= MAX_SLOTS:
            raise UsageError(f"{slots} memory slots of {slot_bytes} bytes are too fine; give a "
                             f"larger slot size (slot_bytes) so the budget is at most {MAX_SLOTS - 1} slots")
        self.inst = inst
        self.mode = mode
        self.slot_bytes = slot_bytes
        self.M = slots
        self.B = inst.batch_max if batch is None else batch  # plan only up to this many samples
        self._number_units(inst)
        self._allocate(inst)
        self._fill_units(inst)
        self._fill_runs(inst)
        for ch in _post_order(inst):
            self._solve_chain(ch)

    # ------------------------------------------------------------------ layout of the arrays

    def _number_units(self, inst: Instance) -> None:
        """Global unit numbering (``Instance.global_units``): chains in id order, units by
        position."""
        self.chain_first_unit = np.zeros(len(inst.chains), np.int64)
        offset = 0
        for ch in inst.chains:
            self.chain_first_unit[ch.cid] = offset
            offset += ch.n
        self.units = inst.global_units
        self.chain_n = np.array([ch.n for ch in inst.chains], np.int64)

    def _allocate(self, inst: Instance) -> None:
        """Every chain's slice of the flat tables: T per (interval, b, m), E and EX per (unit,
        b, m), boundary slots per (boundary, b), sizes per boundary, runs per (interval, b)."""
        B1, M1 = self.B + 1, self.M + 1
        chains = inst.chains
        starts = {name: np.zeros(len(chains), np.int64)
                  for name in ("T", "E", "bslots", "sizes", "runs")}
        total = dict.fromkeys(starts, 0)
        for ch in chains:
            intervals = ch.n * (ch.n + 1) // 2
            for name, size in (("T", intervals * B1 * M1), ("E", ch.n * B1 * M1),
                               ("bslots", (ch.n + 1) * B1), ("sizes", ch.n + 1),
                               ("runs", intervals * B1)):
                starts[name][ch.cid] = total[name]
                total[name] += size
        self.chain_T_start, self.chain_E_start = starts["T"], starts["E"]
        self.chain_bslots_start, self.chain_sizes_start = starts["bslots"], starts["sizes"]
        self.chain_runs_start = starts["runs"]
        U = len(self.units)
        self.T = np.full(total["T"], np.inf)
        self.E = np.full(total["E"], np.inf)   # each unit at exactly b: the executor's own step
        self.EX = np.full(total["E"], np.inf)  # ... or its own call of a runtime, what the DP uses
        self.bslots = np.zeros(total["bslots"], np.int64)
        self.sizes = np.zeros(total["sizes"], np.int64)
        self.unit_block = np.zeros(U, np.bool_)
        self.unit_ws = np.zeros((U, B1), np.int64)
        self.unit_base = np.zeros((U, B1), np.int64)
        self.unit_boff = np.zeros(U, np.int64)
        self.unit_bcnt = np.zeros(U, np.int64)
        # runs: cost, slots and exact bytes per (interval, b); RN = M + 1 where there is none
        self.RC = np.full(total["runs"], np.inf)
        self.RN = np.full(total["runs"], M1, np.int64)
        self.RB = np.zeros(total["runs"], np.int64)

    def _fill_units(self, inst: Instance) -> None:
        """Boundary sizes and slots, and every unit's workspace, block base and branches."""
        B1, slot_bytes = self.B + 1, self.slot_bytes
        branch_chain: list[int] = []
        for ch in inst.chains:
            so, bo = int(self.chain_sizes_start[ch.cid]), int(self.chain_bslots_start[ch.cid])
            self.sizes[so:so + ch.n + 1] = ch.sizes
            for t, s in enumerate(ch.sizes):
                self.bslots[bo + t * B1: bo + (t + 1) * B1] = [slots_up(s * x, slot_bytes) for x in range(B1)]
            for pos, u in enumerate(ch.units):
                g = int(self.chain_first_unit[ch.cid]) + pos
                self.unit_block[g] = u.is_block
                self.unit_ws[g, 1:] = u.ws[:self.B]
                if u.is_block:
                    s = ch.sizes[pos] + ch.sizes[pos + 1]
                    self.unit_base[g] = [slots_up(s * x, slot_bytes) for x in range(B1)]
                    self.unit_boff[g] = len(branch_chain)
                    self.unit_bcnt[g] = len(u.branches)
                    branch_chain.extend(b.cid for b in u.branches)
        self.branch_chain = np.array(branch_chain + [0], np.int64)

    def _fill_runs(self, inst: Instance) -> None:
        """Every span a runtime call may take: its cost, bytes and slots at every b."""
        B1, M1 = self.B + 1, self.M + 1
        for ch in inst.chains:
            if ch.runs is None:
                continue
            for (i, j), (cost, need) in ch.runs.spans.items():
                at = int(self.chain_runs_start[ch.cid]) + kernel.tri(ch.n, i, j) * B1
                for b in range(1, B1):
                    self.RC[at + b] = cost[b - 1]
                    self.RB[at + b] = need[b - 1]
                    self.RN[at + b] = min(slots_up(need[b - 1], self.slot_bytes), M1)

    # ------------------------------------------------------------------ building

    def table(self, cid: int) -> np.ndarray:
        """The (n(n+1)/2, B+1, M+1) view of chain ``cid``'s OPT tables."""
        n = int(self.chain_n[cid])
        o = int(self.chain_T_start[cid])
        size = n * (n + 1) // 2 * (self.B + 1) * (self.M + 1)
        return self.T[o:o + size].reshape(n * (n + 1) // 2, self.B + 1, self.M + 1)

    def exact(self, cid: int, *, calls: bool = False) -> np.ndarray:
        """The (n, B+1, M+1) view of chain ``cid``'s E: each unit at exactly b samples, as a
        step of the executor's own (``calls``: or a call of a runtime, whichever is cheaper)."""
        n = int(self.chain_n[cid])
        o = int(self.chain_E_start[cid])
        flat = self.EX if calls else self.E
        return flat[o:o + n * (self.B + 1) * (self.M + 1)].reshape(n, self.B + 1, self.M + 1)

    def top(self, cid: int = 0) -> np.ndarray:
        """(B+1, M+1): OPT of the whole chain ``cid``; row 0 is 0 (nothing to do)."""
        n = int(self.chain_n[cid])
        if n == 0:  # an empty branch (identity shortcut) costs nothing beyond the fold
            return np.zeros((self.B + 1, self.M + 1))
        return self.table(cid)[kernel.tri(n, 0, n - 1)]

    def _solve_chain(self, ch: Chain) -> None:
        """Fill E for the chain's units (its branch chains are solved already), then its OPT."""
        if ch.n == 0:
            return
        B1, M1 = self.B + 1, self.M + 1
        E = self.exact(ch.cid)
        mvec = np.arange(M1, dtype=np.int64)
        for pos, u in enumerate(ch.units):
            g = int(self.chain_first_unit[ch.cid]) + pos
            cost = np.array((np.inf,) + tuple(u.cost[:self.B]))
            if not u.is_block:
                need = np.array([np.iinfo(np.int64).max] + [
                    slots_up(ch.sizes[pos] * b + u.ws_at(b) + ch.sizes[pos + 1] * b, self.slot_bytes)
                    for b in range(1, B1)], np.int64)
                E[pos] = np.where(mvec[None, :] >= need[:, None], cost[:, None], np.inf)
            else:
                F = np.stack([self.top(b.cid) for b in u.branches]) if u.branches else \
                    np.zeros((0, B1, M1))
                F = np.ascontiguousarray(F)
                fold = np.array([0.0] + list(u.cost[:self.B]))
                kernel.block_exact(F, fold, self.unit_base[g], E[pos])
                E[pos, 0] = np.inf
        bs = self.bslots[int(self.chain_bslots_start[ch.cid]):int(self.chain_bslots_start[ch.cid]) + (ch.n + 1) * B1]
        ro, rn = int(self.chain_runs_start[ch.cid]), ch.n * (ch.n + 1) // 2 * B1
        RC, RN = self.RC[ro:ro + rn].reshape(-1, B1), self.RN[ro:ro + rn].reshape(-1, B1)
        EX = self.exact(ch.cid, calls=True)
        kernel.exact_with_runs(E, RC, RN, ch.n, EX)
        kernel.chain_dp(EX, bs.reshape(ch.n + 1, B1), MODES[self.mode], self.table(ch.cid), RC, RN)

    # ------------------------------------------------------------------ reading plans

    def plan(self, r: int, m: int) -> RawPlan | None:
        """The program of OPT[root, r, m], or None when no schedule fits in m slots."""
        if not 1 <= r <= self.B or not 0 <= m <= self.M:
            raise UsageError(f"(r={r}, m={m}) is outside the tables (r <= {self.B}, m <= {self.M})")
        cap = len(self.units) * r + 1
        out_k = np.empty(cap, np.int64)
        out_u = np.empty(cap, np.int64)
        out_l = np.empty(cap, np.int64)
        out_s = np.empty(cap, np.int64)
        out_n = np.empty(cap, np.int64)
        records, peak = kernel.reconstruct(
            self.T, self.EX, self.E, self.RC, self.RN, self.RB, self.chain_n, self.chain_T_start,
            self.chain_E_start, self.chain_bslots_start, self.chain_first_unit, self.chain_sizes_start, self.chain_runs_start,
            self.bslots, self.sizes, self.unit_block, self.unit_ws, self.unit_base,
            self.unit_boff, self.unit_bcnt, self.branch_chain, self.B + 1, self.M + 1,
            MODES[self.mode], r, m, out_k, out_u, out_l, out_s, out_n)
        if records == -1:
            return None
        if records < 0:
            raise PlanError(f"internal error: the {self.mode} tables do not reproduce their own "
                            f"optimum at r={r}, m={m}; please report this with the profile")
        return self._expand(out_k[:records], out_u[:records], out_l[:records], out_s[:records],
                            out_n[:records], int(peak), float(self.top()[r, m]))

    def _expand(self, kinds: np.ndarray, first: np.ndarray, last: np.ndarray,
                samples: np.ndarray, needs: np.ndarray, peak: int, cost: float) -> RawPlan:
        """The program of the read-out records: a span becomes the steps of its units (a
        block's phase, then its branches' units, in fold order), named for the runtime that
        runs them, and one run."""
        inst = self.inst
        named = bool(inst.runtimes)
        units: list[int] = []
        sizes: list[int] = []
        step_needs: list[int] = []
        runtimes: list[str] = []
        runs: list[tuple[int, int]] = []
        index = inst.global_index
        for kind, g0, g1, c, need in zip(kinds.tolist(), first.tolist(), last.tolist(),
                                          samples.tolist(), needs.tolist()):
            if kind == kernel.STEP:
                units.append(g0)
                sizes.append(c)
                step_needs.append(need)
                runtimes.append(rt.TORCH if named else "")
                continue
            start = len(units)
            for g in range(g0, g1 + 1):
                for name in _whole(self.units[g]):
                    units.append(index[name])
                    sizes.append(c)
                    step_needs.append(need)
                    runtimes.append(inst.grouping)
            runs.append((start, len(units) - 1))
        return RawPlan(np.array(units, np.int64), np.array(sizes, np.int64),
                       np.array(step_needs, np.int64), peak, cost, tuple(runtimes), tuple(runs))


def _whole(unit: Unit) -> list[str]:
    """The names of a unit's steps when it runs whole at one batch size: itself, and for a
    block every unit of its branches in fold order."""
    names = [unit.name]
    for branch in unit.branches:  # fold order: only identity branches (no units) move
        for u in branch.units:
            names.extend(_whole(u))
    return names


def _post_order(inst: Instance) -> list[Chain]:
    """Chains with every branch chain before the chain that holds its block."""
    out: list[Chain] = []

    def visit(ch: Chain) -> None:
        for u in ch.units:
            for b in u.branches:
                visit(b)
        out.append(ch)

    visit(inst.root)
    return out
