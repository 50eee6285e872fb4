"""An exhaustive oracle: the true optimum over every sequential schedule, by Dijkstra.

It reads the Profile tree directly (not the solver's model) so that it checks the solver
and the simulator from outside. A state is, for the main chain, how many samples wait at
each boundary, plus the open phase of a parallel block if any: (block position, phase size,
current branch, the branch chain's own state, recursively). A move runs one unit on c of the
samples waiting at its input, or opens a block phase of c samples, exactly as docs/architecture.md's
model of memory says; Dijkstra over moves gives the least total cost to bring all r samples
to the output within the budget. Exponential: only for tiny instances (tests).
"""

from __future__ import annotations

import heapq
import itertools
import math

from planner.tree import Layer, Parallel, Profile, Series


def _flatten(node):
    if isinstance(node, Series):
        return [u for child in node.children for u in _flatten(child)]
    return [node]


class _Chain:
    def __init__(self, node, is_branch: bool):
        self.units = _flatten(node)
        n = len(self.units)
        if n:
            self.sizes = [self.units[0].in_bytes] + [u.out_bytes for u in self.units]
        else:
            self.sizes = [0]
        # What a layer's output costs while it runs (its boundary size, but for a layer
        # ending a branch: its real output, which is folded into the join right after).
        self.run_out = list(self.sizes[1:])
        if is_branch:
            self.sizes[0] = 0
            if n and isinstance(self.units[-1], Layer):
                self.sizes[-1] = 0
        self.branches = [[_Chain(b, True) for b in u.branches] if isinstance(u, Parallel) else None
                         for u in self.units]


def _cost(unit, c: int, objective: str) -> float:
    values = getattr(unit, objective)
    return float(values[c - 1]) if values else 0.0


def _held(chain: _Chain, counts) -> int:
    return sum(w * s for w, s in zip(counts, chain.sizes))


def _start(chain: _Chain, b: int):
    return (tuple([b] + [0] * len(chain.units)), None)


def _advance(chain: _Chain, counts, pos: int, b: int, alpha: int):
    """Enter branch alpha (skipping empty ones), or close the phase when none is left."""
    branches = chain.branches[pos]
    while alpha < len(branches) and not branches[alpha].units:
        alpha += 1
    if alpha == len(branches):
        new = list(counts)
        new[pos] -= b
        new[pos + 1] += b
        return (tuple(new), None)
    return (counts, (pos, b, alpha, _start(branches[alpha], b)))


def _moves(chain: _Chain, state, outside: int, budget: int, objective: str):
    """Yield (cost, (unit name, c), new state) for every move allowed from ``state``."""
    counts, open_ = state
    held = outside + _held(chain, counts)
    if open_ is None:
        for pos, unit in enumerate(chain.units):
            for c in range(1, counts[pos] + 1):
                if isinstance(unit, Layer):
                    need = held + unit.ws[c - 1] + chain.run_out[pos] * c
                    if need > budget:
                        continue
                    new = list(counts)
                    new[pos] -= c
                    new[pos + 1] += c
                    yield _cost(unit, c, objective), (unit.name, c), (tuple(new), None)
                else:
                    need = held + chain.sizes[pos + 1] * c
                    if need > budget:
                        continue
                    yield (_cost(unit, c, objective), (unit.name, c),
                           _advance(chain, counts, pos, c, 0))
        return
    pos, b, alpha, inner = open_
    branch = chain.branches[pos][alpha]
    inner_outside = held + chain.sizes[pos + 1] * b
    for cost, step, new_inner in _moves(branch, inner, inner_outside, budget, objective):
        if new_inner[1] is None and new_inner[0][-1] == b:  # the branch is done
            yield cost, step, _advance(chain, counts, pos, b, alpha + 1)
        else:
            yield cost, step, (counts, (pos, b, alpha, new_inner))


def oracle(profile: Profile, r: int, budget: int, objective: str = "time"):
    """(least cost, program as [(unit, c), ...]) or (inf, None) when nothing fits."""
    root = _Chain(profile.root, False)
    start = _start(root, r)
    goal = (tuple([0] * len(root.units) + [r]), None)
    tie = itertools.count()
    best = {start: 0.0}
    back = {start: None}
    heap = [(0.0, next(tie), start)]
    while heap:
        d, _, state = heapq.heappop(heap)
        if d > best.get(state, math.inf):
            continue
        if state == goal:
            program = []
            while back[state] is not None:
                state, step = back[state]
                program.append(step)
            return d, program[::-1]
        for cost, step, new in _moves(root, state, 0, budget, objective):
            nd = d + cost
            if nd < best.get(new, math.inf):
                best[new] = nd
                back[new] = (state, step)
                heapq.heappush(heap, (nd, next(tie), new))
    return math.inf, None


# --------------------------------------------------------------------------- instances for tests


def chain_profile(layers: list[tuple[int, int, list[float], list[int]]], *, batch_max: int,
                  energy: list[list[float]] | None = None) -> Profile:
    """A hand-made chain: one (in, out, times, ws) per layer, named L0, L1, ..."""
    from planner.tree import profile_from_json
    root = []
    for k, (i, o, t, w) in enumerate(layers):
        node = {"kind": "layer", "name": f"L{k}", "in": i, "out": o, "time": list(t), "ws": list(w)}
        if energy is not None:
            node["energy"] = list(energy[k])
        root.append(node)
    return profile_from_json({"schema": "vbs.profile/1", "batch_max": batch_max, "root": root})


def strategies():
    """Hypothesis strategies for tiny chains and trees: (profile, r, budget)."""
    from hypothesis import strategies as st

    from planner.tree import profile_from_json

    @st.composite
    def small_chain(draw, max_units: int = 5, max_batch: int = 5, max_size: int = 3,
                    max_ws: int = 4, max_time: int = 10):
        n = draw(st.integers(1, max_units))
        B = draw(st.integers(1, max_batch))
        sizes = [draw(st.integers(0, max_size)) for _ in range(n + 1)]
        layers = []
        for k in range(n):
            times = [float(draw(st.integers(1, max_time))) for _ in range(B)]
            ws = [draw(st.integers(0, max_ws)) for _ in range(B)]
            layers.append((sizes[k], sizes[k + 1], times, ws))
        profile = chain_profile(layers, batch_max=B)
        r = draw(st.integers(1, B))
        # budgets between "one sample through the hungriest layer" and "all r at once"
        lo = max(sizes[0] * r, max(i + w[0] + o for i, o, _, w in layers))
        hi = max(i * r + w[r - 1] + o * r for i, o, _, w in layers)
        budget = draw(st.integers(max(0, lo - 1), max(lo, hi)))
        return profile, r, budget

    @st.composite
    def small_tree(draw, max_layers: int = 5, max_batch: int = 4):
        B = draw(st.integers(1, max_batch))
        count = [0]

        def layer(i, o):
            count[0] += 1
            return {"kind": "layer", "name": f"L{count[0]}", "in": i, "out": o,
                    "time": [float(draw(st.integers(1, 9))) for _ in range(B)],
                    "ws": [draw(st.integers(0, 3)) for _ in range(B)]}

        def chain(n, s_in, s_out, depth):
            nodes, s = [], s_in
            for k in range(n):
                o = s_out if k == n - 1 else draw(st.integers(0, 3))
                if depth < 2 and count[0] < max_layers and draw(st.integers(0, 2)) == 0:
                    count[0] += 1
                    name = f"P{count[0]}"
                    branches = []
                    for a in range(draw(st.integers(1, 3))):
                        m = draw(st.integers(0, 2)) if count[0] < max_layers else 0
                        kids = chain(m, draw(st.integers(0, 3)), draw(st.integers(0, 3)), depth + 1)
                        branches.append({"kind": "series", "name": f"{name}.{a}", "children": kids})
                    fold = [float(draw(st.integers(0, 2))) for _ in range(B)]
                    nodes.append({"kind": "parallel", "name": name, "in": s, "out": o,
                                  "join": "cat", "branches": branches, "time": fold})
                else:
                    nodes.append(layer(s, o))
                s = o
            return nodes

        n = draw(st.integers(1, 3))
        root = chain(n, draw(st.integers(0, 3)), draw(st.integers(0, 3)), 0)
        if not any(True for _ in _layers_of(root)):
            root.append(layer(root[-1]["out"], draw(st.integers(0, 3))))
        profile = profile_from_json({"schema": "vbs.profile/1", "batch_max": B, "root": root})
        r = draw(st.integers(1, B))
        budget = draw(st.integers(0, 24))
        return profile, r, budget

    return small_chain, small_tree


def _layers_of(nodes):
    for n in nodes:
        if n["kind"] == "layer":
            yield n
        elif n["kind"] == "parallel":
            for b in n["branches"]:
                yield from _layers_of(b["children"])
