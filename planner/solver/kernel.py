"""The DP kernels (numba): recurrences (1)-(3) of the paper and the vbs recurrence, per chain.

One chain of n units is solved for every interval [i, j] of units, every batch b = 1..B and
every memory m = 0..M slots. ``T[tri(i, j), b, m]`` is OPT: the least total cost to move b
samples from boundary i to boundary j+1 within m slots, counting the b inputs while they wait
and the outputs as they arrive (recurrence (2)):

    OPT[i,j,b,m] = min over 1 <= b1 <= b of
                   X[i,j,b1, m - in(i, b-b1)] + OPT[i,j,b-b1, m - out(j, b1)],   OPT[.,.,0,m] = 0

where ``in``/``out`` are the slot-rounded bytes held at the two ends. X is the cost of one
phase that moves all b1 samples through the interval before the next phase starts:

- ``paper`` (recurrence (1), OPTExact): some unit k runs all b samples at once,
  X = OPT[i,k-1,b,m] + E[k,b,m] + OPT[k+1,j,b,m];
- ``vbs``: the interval splits between ANY two units k, k+1 with all b samples crossing,
  X = OPT[i,k,b,m] + OPT[k+1,j,b,m] (a strict superset of the paper's phases, since
  OPT[k,j] <= E[k] + OPT[k+1,j]); a single unit is X = E[k,b,m]; and, on intervals of at
  most CARRY_MAX_LEN units, the four-step "carry" phases of ``_carry`` (the pattern the
  exhaustive oracle finds where the splits miss the optimum).

E[k,b,m] (recurrence (3)) is the cost of unit k at exactly b samples in m slots: a layer's
cost when it fits, a block's fold cost plus its branches' OPT in what the fork and join leave.

Runs (``planner.solver.model.RunTable``): where a runtime runs units i..j as one call, the
phase may be that call, ``R[i,j,b] = RC[tri(i,j), b]`` where ``m >= RN[tri(i,j), b]`` (its cost
and slots), so a phase pays each call and each cut it makes. The kernels' E already holds a
unit's call of its own, E[k] = min(the executor's own step, R[k,k]) (``exact_with_runs``), in
both modes; in ``vbs`` X[i,j] also considers R[i,j] (before the splits: a run is preferred on
a tie). Without a runtime that runs units in calls, RC is infinite throughout.

Work is O(n^3 B M) for the splits, O(n^2 B^2 M) for the phases and O(n CARRY_MAX_LEN^2 B^3 M)
for the carries, every inner loop running along the contiguous memory axis (vectorised by
LLVM). ``reconstruct`` recovers a program by recomputing the same sums in the same order, so
an argmin is found by exact float equality and no choice tables are stored.
"""

from __future__ import annotations

import numpy as np
from numba import njit

INF = np.inf
MODE_VBS = 0
MODE_PAPER = 1
# carries are tried on intervals of at most this many units: O(n L^2 B^3 M) work; on random
# small chains, length 4 leaves about a tenth of the gap to the optimum that length 2 leaves
CARRY_MAX_LEN = 4

# task kinds of the reconstruction stack
_OPT, _X, _UNIT = 0, 1, 2
# what ``_xval`` returns as its argmin when the run of the whole interval wins
RUN = -3
# kinds of the records ``reconstruct`` writes: a step of one unit, or a run of units i..j
STEP, SPAN = 0, 1


@njit(cache=True, inline="always")
def tri(n: int, i: int, j: int) -> int:
    """Index of interval [i, j] (0 <= i <= j < n) in row-major upper-triangular order."""
    return i * n - (i * (i - 1)) // 2 + (j - i)


# The inner loops run over slices starting at 0: LLVM vectorises those (about 5x faster than
# the same loop over a shifted or offset range of the whole arrays, measured).


@njit(cache=True, inline="always")
def _min2(xs, As, Cs):
    """xs = min(xs, As + Cs), element-wise, in place."""
    for m in range(xs.shape[0]):
        v = As[m] + Cs[m]
        if v < xs[m]:
            xs[m] = v


@njit(cache=True, inline="always")
def _min3(xs, As, Es, Cs):
    """xs = min(xs, (As + Es) + Cs), element-wise, in place."""
    for m in range(xs.shape[0]):
        v = (As[m] + Es[m]) + Cs[m]
        if v < xs[m]:
            xs[m] = v


@njit(cache=True, inline="always")
def _min4(xs, P, Q, R, S):
    """xs = min(xs, ((P + Q) + R) + S), element-wise, in place."""
    for m in range(xs.shape[0]):
        v = ((P[m] + Q[m]) + R[m]) + S[m]
        if v < xs[m]:
            xs[m] = v


@njit(cache=True)
def _carry(T, LO, bslots, n, i, j, k, b, M1, x):
    """Lower ``x`` (X of [i, j] at b samples) by the four-step carry phases split after unit k.

    Left = units i..k, right = units k+1..j: left moves c1 samples (b-c1 wait at the input),
    right moves d1 < c1 of them (c1-d1 stay at the split), left moves the other b-c1, right
    moves all b-d1 left. With 1 <= d1 < c1 < b this is outside both the paper's phases and
    the plain splits; it is what the exhaustive oracle finds when they miss the optimum.
    """
    ta = tri(n, i, k)
    tc = tri(n, k + 1, j)
    A = T[ta]
    C = T[tc]
    for c1 in range(2, b):
        a = bslots[i, b - c1]
        for d1 in range(1, c1):
            kc = bslots[k + 1, c1 - d1]
            od = bslots[j + 1, d1]
            # start where all four terms are finite (LO: first finite m of each row)
            lo = a + LO[ta, c1]
            if a + kc + LO[tc, d1] > lo:
                lo = a + kc + LO[tc, d1]
            if kc + od + LO[ta, b - c1] > lo:
                lo = kc + od + LO[ta, b - c1]
            if od + LO[tc, b - d1] > lo:
                lo = od + LO[tc, b - d1]
            if lo >= M1:
                continue
            _min4(x[lo:], A[c1, lo - a:M1 - a], C[d1, lo - a - kc:M1 - a - kc],
                  A[b - c1, lo - kc - od:M1 - kc - od], C[b - d1, lo - od:M1 - od])


@njit(cache=True, inline="always")
def _run_in(x, rc, rn):
    """x = min(x, rc) where m >= rn (a run of rn slots costing rc), in place."""
    for m in range(rn, x.shape[0]):
        if rc < x[m]:
            x[m] = rc


@njit(cache=True)
def exact_with_runs(E, RC, RN, n, EX):
    """EX = E, lowered to R[k,k] (a call of unit k alone) where that fits and costs less."""
    EX[:] = E
    for k in range(n):
        t = tri(n, k, k)
        for b in range(1, E.shape[1]):
            _run_in(EX[k, b], RC[t, b], RN[t, b])


@njit(cache=True)
def chain_dp(E, bslots, mode, T, RC, RN):
    """Fill ``T`` (n(n+1)/2, B+1, M+1) for one chain; ``E`` is (n, B+1, M+1), ``bslots`` (n+1, B+1),
    ``RC``/``RN`` (n(n+1)/2, B+1) the runs' costs and slots."""
    n, B1, M1 = E.shape
    X = np.empty((B1, M1))
    XLO = np.empty(B1, np.int64)
    # LO[t, b]: the first m where T[t, b, m] is finite; rows are non-increasing in m, so the
    # phase and carry loops may start there (a pure speed-up: the values are the same)
    LO = np.full((n * (n + 1) // 2, B1), M1, np.int64)
    for L in range(1, n + 1):
        for i in range(0, n - L + 1):
            j = i + L - 1
            t = tri(n, i, j)
            for b in range(1, B1):
                x = X[b]
                if L == 1:
                    x[:] = E[i, b]
                elif mode == MODE_VBS:
                    x[:] = INF
                    _run_in(x, RC[t, b], RN[t, b])
                    for k in range(i, j):
                        ta = tri(n, i, k)
                        tc = tri(n, k + 1, j)
                        lo = LO[ta, b] if LO[ta, b] > LO[tc, b] else LO[tc, b]
                        _min2(x[lo:], T[ta, b, lo:], T[tc, b, lo:])
                    if L <= CARRY_MAX_LEN:
                        for k in range(i, j):
                            _carry(T, LO, bslots, n, i, j, k, b, M1, x)
                else:
                    x[:] = INF
                    for k in range(i, j + 1):
                        if k == i:
                            _min2(x, E[k, b], T[tri(n, k + 1, j), b])
                        elif k == j:
                            _min2(x, T[tri(n, i, k - 1), b], E[k, b])
                        else:
                            _min3(x, T[tri(n, i, k - 1), b], E[k, b], T[tri(n, k + 1, j), b])
                o = T[t, b]
                o[:] = x
                first = M1
                for m in range(M1):
                    if x[m] < INF:
                        first = m
                        break
                XLO[b] = first
                for b1 in range(1, b):
                    a = bslots[i, b - b1]
                    c = bslots[j + 1, b1]
                    lo = a + XLO[b1]
                    if c + LO[t, b - b1] > lo:
                        lo = c + LO[t, b - b1]
                    if lo >= M1:
                        continue
                    _min2(o[lo:], X[b1, lo - a:M1 - a], T[t, b - b1, lo - c:M1 - c])
                first = M1
                for m in range(M1):
                    if o[m] < INF:
                        first = m
                        break
                LO[t, b] = first


@njit(cache=True)
def block_exact(F, fold, base, E_out):
    """E of a block: ``fold[b] + sum of branch tops F[a][b, m - base[b]]`` (in branch order)."""
    nb = F.shape[0]
    B1 = E_out.shape[0]
    M1 = E_out.shape[1]
    for b in range(1, B1):
        s = base[b]
        for m in range(M1):
            if m < s:
                E_out[b, m] = INF
            else:
                v = fold[b]
                for a in range(nb):
                    v = v + F[a, b, m - s]
                E_out[b, m] = v


@njit(cache=True)
def _xval(T, E, bslots, RC, RN, toff, eoff, boff, roff, n, i, j, b, m, B1, M1, mode):
    """X[i,j,b,m] of one chain recomputed exactly as chain_dp does; its argmin k (RUN when the
    run of units i..j wins), and (c1, d1) when a carry wins (c1 = 0 otherwise)."""
    r = roff + tri(n, i, j) * B1 + b
    if i == j:
        return E[eoff + (i * B1 + b) * M1 + m], i, 0, 0
    best = INF
    arg = -1
    c1best = 0
    d1best = 0
    if mode == MODE_VBS and m >= RN[r]:
        best = RC[r]
        arg = RUN
    if mode == MODE_VBS:
        for k in range(i, j):
            v = T[toff + (tri(n, i, k) * B1 + b) * M1 + m] + T[toff + (tri(n, k + 1, j) * B1 + b) * M1 + m]
            if v < best:
                best = v
                arg = k
        if j - i + 1 <= CARRY_MAX_LEN:
            for k in range(i, j):
                ta = toff + tri(n, i, k) * B1 * M1
                tc = toff + tri(n, k + 1, j) * B1 * M1
                for c1 in range(2, b):
                    a = bslots[boff + i * B1 + (b - c1)]
                    for d1 in range(1, c1):
                        kc = bslots[boff + (k + 1) * B1 + (c1 - d1)]
                        od = bslots[boff + (j + 1) * B1 + d1]
                        if m - a - kc < 0 or m - kc - od < 0:
                            continue
                        v = ((T[ta + c1 * M1 + m - a] + T[tc + d1 * M1 + m - a - kc])
                             + T[ta + (b - c1) * M1 + m - kc - od]) + T[tc + (b - d1) * M1 + m - od]
                        if v < best:
                            best = v
                            arg = k
                            c1best = c1
                            d1best = d1
    else:
        for k in range(i, j + 1):
            e = E[eoff + (k * B1 + b) * M1 + m]
            if k == i:
                v = e + T[toff + (tri(n, k + 1, j) * B1 + b) * M1 + m]
            elif k == j:
                v = T[toff + (tri(n, i, k - 1) * B1 + b) * M1 + m] + e
            else:
                v = (T[toff + (tri(n, i, k - 1) * B1 + b) * M1 + m] + e) + \
                    T[toff + (tri(n, k + 1, j) * B1 + b) * M1 + m]
            if v < best:
                best = v
                arg = k
    return best, arg, c1best, d1best


@njit(cache=True, inline="always")
def _record(out_kind, out_unit, out_last, out_samples, out_need, nrec, kind, first, last, b, need):
    """Write record ``nrec``; returns the next record's index."""
    out_kind[nrec] = kind
    out_unit[nrec] = first
    out_last[nrec] = last
    out_samples[nrec] = b
    out_need[nrec] = need
    return nrec + 1


@njit(cache=True)
def reconstruct(T, EX, E, RC, RN, RB, chain_n, chain_toff, chain_eoff, chain_boff, chain_uoff,
                chain_soff, chain_roff, bslots, sizes, unit_block, unit_ws, unit_base, unit_boff,
                unit_bcnt, branch_chain, B1, M1, mode, r, m0,
                out_kind, out_unit, out_last, out_samples, out_need):
    """Write the records of OPT[root, r, m0] into ``out_*``; return (records, exact peak bytes).

    A record is a STEP (``out_unit`` runs ``out_samples`` samples: a layer, or a block's phase
    whose branches' records follow) or a SPAN (units ``out_unit..out_last`` of one chain, in
    global numbering, as one call of the runtime that runs units in calls, blocks whole).
    ``EX`` is E with each unit's call of its own (what the tables were built with), ``E`` the
    executor's own steps alone: a unit runs as a call where that is what lowered EX.
    Every task carries the exact bytes held outside its interval, so each record's exact need
    (``out_need``) and the peak are computed here, independently of the simulator.
    Returns records = -1 when the entry is infinite (no schedule), -2 if the tables disagree
    with their recomputation (a bug).
    """
    cap = 64 + 8 * out_unit.shape[0]
    st_kind = np.empty(cap, np.int64)
    st_c = np.empty(cap, np.int64)
    st_i = np.empty(cap, np.int64)
    st_j = np.empty(cap, np.int64)
    st_b = np.empty(cap, np.int64)
    st_m = np.empty(cap, np.int64)
    st_off = np.empty(cap, np.int64)
    n0 = chain_n[0]
    if T[chain_toff[0] + (tri(n0, 0, n0 - 1) * B1 + r) * M1 + m0] == INF:
        return -1, 0
    st_kind[0] = _OPT; st_c[0] = 0; st_i[0] = 0; st_j[0] = n0 - 1
    st_b[0] = r; st_m[0] = m0; st_off[0] = 0
    sp = 1
    nrec = 0
    peak = 0
    while sp > 0:
        sp -= 1
        kind = st_kind[sp]; c = st_c[sp]; i = st_i[sp]; j = st_j[sp]
        b = st_b[sp]; m = st_m[sp]; off = st_off[sp]
        n = chain_n[c]
        toff = chain_toff[c]
        eoff = chain_eoff[c]
        boff = chain_boff[c]
        soff = chain_soff[c]
        roff = chain_roff[c]
        if kind == _OPT:
            if b == 0:
                continue
            t = tri(n, i, j)
            v = T[toff + (t * B1 + b) * M1 + m]
            xv, _, _, _ = _xval(T, EX, bslots, RC, RN, toff, eoff, boff, roff, n, i, j, b, m, B1,
                                M1, mode)
            if xv == v:
                st_kind[sp] = _X; st_c[sp] = c; st_i[sp] = i; st_j[sp] = j
                st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                sp += 1
                continue
            found = False
            for b1 in range(b - 1, 0, -1):
                a = bslots[boff + i * B1 + (b - b1)]
                cc = bslots[boff + (j + 1) * B1 + b1]
                if m - a < 0 or m - cc < 0:
                    continue
                rest = T[toff + (t * B1 + (b - b1)) * M1 + (m - cc)]
                if rest == INF:
                    continue
                xv, _, _, _ = _xval(T, EX, bslots, RC, RN, toff, eoff, boff, roff, n, i, j, b1,
                                    m - a, B1, M1, mode)
                if xv + rest == v:
                    # the rest runs second, with the first phase's b1 outputs held at the end
                    st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = i; st_j[sp] = j
                    st_b[sp] = b - b1; st_m[sp] = m - cc
                    st_off[sp] = off + sizes[soff + j + 1] * b1
                    sp += 1
                    # the first phase runs first, with the other b - b1 inputs waiting
                    st_kind[sp] = _X; st_c[sp] = c; st_i[sp] = i; st_j[sp] = j
                    st_b[sp] = b1; st_m[sp] = m - a
                    st_off[sp] = off + sizes[soff + i] * (b - b1)
                    sp += 1
                    found = True
                    break
            if not found:
                return -2, 0
        elif kind == _X:
            _, k, c1, d1 = _xval(T, EX, bslots, RC, RN, toff, eoff, boff, roff, n, i, j, b, m,
                                 B1, M1, mode)
            if k == RUN:
                need = off + RB[roff + tri(n, i, j) * B1 + b]
                nrec = _record(out_kind, out_unit, out_last, out_samples, out_need, nrec, SPAN,
                               chain_uoff[c] + i, chain_uoff[c] + j, b, need)
                peak = max(peak, need)
                continue
            if i == j:
                st_kind[sp] = _UNIT; st_c[sp] = c; st_i[sp] = i; st_j[sp] = i
                st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                sp += 1
                continue
            if k < 0:
                return -2, 0
            if c1 > 0:
                # carry phases of left = i..k and right = k+1..j, pushed last-first
                a = bslots[boff + i * B1 + (b - c1)]
                kc = bslots[boff + (k + 1) * B1 + (c1 - d1)]
                od = bslots[boff + (j + 1) * B1 + d1]
                s_in = sizes[soff + i]
                s_mid = sizes[soff + k + 1]
                s_out = sizes[soff + j + 1]
                st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = k + 1; st_j[sp] = j
                st_b[sp] = b - d1; st_m[sp] = m - od; st_off[sp] = off + s_out * d1
                sp += 1
                st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = i; st_j[sp] = k
                st_b[sp] = b - c1; st_m[sp] = m - kc - od
                st_off[sp] = off + s_mid * (c1 - d1) + s_out * d1
                sp += 1
                st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = k + 1; st_j[sp] = j
                st_b[sp] = d1; st_m[sp] = m - a - kc
                st_off[sp] = off + s_in * (b - c1) + s_mid * (c1 - d1)
                sp += 1
                st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = i; st_j[sp] = k
                st_b[sp] = c1; st_m[sp] = m - a; st_off[sp] = off + s_in * (b - c1)
                sp += 1
            elif mode == MODE_VBS:
                st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = k + 1; st_j[sp] = j
                st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                sp += 1
                st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = i; st_j[sp] = k
                st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                sp += 1
            else:
                if k < j:
                    st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = k + 1; st_j[sp] = j
                    st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                    sp += 1
                st_kind[sp] = _UNIT; st_c[sp] = c; st_i[sp] = k; st_j[sp] = k
                st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                sp += 1
                if k > i:
                    st_kind[sp] = _OPT; st_c[sp] = c; st_i[sp] = i; st_j[sp] = k - 1
                    st_b[sp] = b; st_m[sp] = m; st_off[sp] = off
                    sp += 1
        else:
            r1 = roff + tri(n, i, i) * B1 + b
            if m >= RN[r1] and RC[r1] < E[eoff + (i * B1 + b) * M1 + m]:  # its own call
                need = off + RB[r1]
                nrec = _record(out_kind, out_unit, out_last, out_samples, out_need, nrec, SPAN,
                               chain_uoff[c] + i, chain_uoff[c] + i, b, need)
                peak = max(peak, need)
                continue
            g = chain_uoff[c] + i
            s_in = sizes[soff + i]
            s_out = sizes[soff + i + 1]
            need = off + (s_in + s_out) * b + (0 if unit_block[g] else unit_ws[g, b])
            nrec = _record(out_kind, out_unit, out_last, out_samples, out_need, nrec, STEP, g, g,
                           b, need)
            peak = max(peak, need)
            if unit_block[g]:
                mb = m - unit_base[g, b]
                # branches run in order: push them last-first
                for a in range(unit_bcnt[g] - 1, -1, -1):
                    bc = branch_chain[unit_boff[g] + a]
                    if chain_n[bc] == 0:
                        continue
                    st_kind[sp] = _OPT; st_c[sp] = bc; st_i[sp] = 0; st_j[sp] = chain_n[bc] - 1
                    st_b[sp] = b; st_m[sp] = mb; st_off[sp] = need
                    sp += 1
    return nrec, peak
