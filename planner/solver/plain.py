"""The same recurrences as ``kernel`` in plain Python: a cross-check and a speed reference.

``plain_top`` returns OPT of the root chain for every b = 0..B and m = 0..M slots, computed
with lists and loops only (no numpy, no numba), with the same slot accounting as
``planner.solver.dp``. It is meant for small instances: tests compare it entry by entry with
the fast kernels, and ``planner.solver.build_times`` times both.
"""

from __future__ import annotations

import math

from planner.solver.kernel import CARRY_MAX_LEN
from core.sizes import slots_up
from planner.solver.model import Chain, Instance

INF = math.inf


def _chain_top(ch: Chain, mode: str, B: int, M: int, slot: int, tops: dict[int, list[list[float]]]
               ) -> list[list[float]]:
    """OPT of one chain over all its units: T[0, n-1] of every interval, shortest first."""
    n = ch.n
    M1 = M + 1
    if n == 0:
        return [[0.0] * M1 for _ in range(B + 1)]
    bsl = [[slots_up(s * x, slot) for x in range(B + 1)] for s in ch.sizes]
    E = [_exact(ch, pos, B, M, slot, tops) for pos in range(n)]
    T: dict[tuple[int, int], list[list[float]]] = {}
    for L in range(1, n + 1):
        for i in range(0, n - L + 1):
            j = i + L - 1
            X = [[INF] * M1 for _ in range(B + 1)]
            O = [[INF] * M1 for _ in range(B + 1)]
            span = ch.runs.spans.get((i, j)) if ch.runs is not None else None
            for b in range(1, B + 1):
                x = X[b]
                if L == 1:
                    x[:] = E[i][b]
                if span is not None and L > 1 and mode == "vbs":  # the run of units i..j
                    rc, rn = span[0][b - 1], slots_up(span[1][b - 1], slot)
                    for m in range(rn, M1):
                        if rc < x[m]:
                            x[m] = rc
                if L > 1 and mode == "vbs":
                    _split_anywhere(x, T, i, j, b, M1)
                    if L <= CARRY_MAX_LEN:
                        _carry(x, T, bsl, i, j, b, M1)
                elif L > 1:
                    _paper_exact(x, T, E, i, j, b, M1)
                _phases(O, X, bsl, i, j, b, M1)
            T[i, j] = O
    return T[0, n - 1]


def _exact(ch: Chain, pos: int, B: int, M: int, slot: int, tops: dict[int, list[list[float]]]
           ) -> list[list[float]]:
    """E[b][m]: unit ``pos`` at exactly b samples within m slots (recurrence (3) / the
    collapse), or its own call of a runtime where that is cheaper."""
    u, M1 = ch.units[pos], M + 1
    rows = [[INF] * M1]
    for b in range(1, B + 1):
        if not u.is_block:
            need = slots_up(ch.sizes[pos] * b + u.ws_at(b) + ch.sizes[pos + 1] * b, slot)
            rows.append([u.cost_at(b) if m >= need else INF for m in range(M1)])
            continue
        base = slots_up((ch.sizes[pos] + ch.sizes[pos + 1]) * b, slot)
        row = []
        for m in range(M1):
            if m < base:
                row.append(INF)
                continue
            v = u.cost_at(b)
            for br in u.branches:
                v = v + tops[br.cid][b][m - base]
            row.append(v)
        rows.append(row)
    if ch.runs is not None and (pos, pos) in ch.runs.spans:
        cost, need = ch.runs.spans[pos, pos]
        for b in range(1, B + 1):
            rn = slots_up(need[b - 1], slot)
            rows[b] = [min(v, cost[b - 1]) if m >= rn else v for m, v in enumerate(rows[b])]
    return rows


def _split_anywhere(x: list[float], T: dict[tuple[int, int], list[list[float]]], i: int, j: int,
                    b: int, M1: int) -> None:
    """vbs: all b samples cross a split between any two units k, k+1 of i..j."""
    for k in range(i, j):
        A, C = T[i, k][b], T[k + 1, j][b]
        for m in range(M1):
            v = A[m] + C[m]
            if v < x[m]:
                x[m] = v


def _carry(x: list[float], T: dict[tuple[int, int], list[list[float]]], bsl: list[list[int]],
           i: int, j: int, b: int, M1: int) -> None:
    """vbs: the carry phases (``kernel._carry``)."""
    for k in range(i, j):
        A, C = T[i, k], T[k + 1, j]
        for c1 in range(2, b):
            a = bsl[i][b - c1]
            for d1 in range(1, c1):
                kc, od = bsl[k + 1][c1 - d1], bsl[j + 1][d1]
                for m in range(max(a + kc, kc + od), M1):
                    v = ((A[c1][m - a] + C[d1][m - a - kc])
                         + A[b - c1][m - kc - od]) + C[b - d1][m - od]
                    if v < x[m]:
                        x[m] = v


def _paper_exact(x: list[float], T: dict[tuple[int, int], list[list[float]]],
                 E: list[list[list[float]]], i: int, j: int, b: int, M1: int) -> None:
    """paper, recurrence (1): some unit k of i..j at the full batch b."""
    for k in range(i, j + 1):
        e = E[k][b]
        for m in range(M1):
            if k == i:
                v = e[m] + T[k + 1, j][b][m]
            elif k == j:
                v = T[i, k - 1][b][m] + e[m]
            else:
                v = (T[i, k - 1][b][m] + e[m]) + T[k + 1, j][b][m]
            if v < x[m]:
                x[m] = v


def _phases(O: list[list[float]], X: list[list[float]], bsl: list[list[int]], i: int, j: int,
            b: int, M1: int) -> None:
    """Recurrence (2): b samples as an exact phase of b1 and the rest, for every b1."""
    o = O[b]
    o[:] = X[b]
    for b1 in range(1, b):
        a, c = bsl[i][b - b1], bsl[j + 1][b1]
        xb, ob = X[b1], O[b - b1]
        for m in range(max(a, c), M1):
            v = xb[m - a] + ob[m - c]
            if v < o[m]:
                o[m] = v


def plain_top(inst: Instance, mode: str, slot_bytes: int, slots: int, batch: int | None = None
              ) -> list[list[float]]:
    """OPT[root][b][m] for b = 0..batch (row 0 is unused) and m = 0..slots, in pure Python."""
    B = inst.batch_max if batch is None else batch
    tops: dict[int, list[list[float]]] = {}

    def visit(ch: Chain) -> None:
        for u in ch.units:
            for br in u.branches:
                visit(br)
        tops[ch.cid] = _chain_top(ch, mode, B, slots, slot_bytes, tops)

    visit(inst.root)
    return tops[inst.root.cid]
