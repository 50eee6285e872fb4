"""An exhaustive oracle: the true optimum over every sequential schedule, by Dijkstra.

It reads the Profile tree directly (not the solver's model) so that it checks the solver
and the simulator from outside. A state is, for the main chain, how many samples wait at
each boundary, plus the open phase of a parallel block if any: (block position, phase size,
current branch, the branch chain's own state, recursively). A move runs one unit on c of the
samples waiting at its input, or opens a block phase of c samples, exactly as docs/architecture.md's
model of memory says; where the profile measured ONNX Runtime, a move may also be one call
of it on c samples through consecutive children of one series (a block whole), with nothing
waiting between them: it costs its units' times inside the run plus the call (read here from
the profile's meta, as the executor pays it), and needs what ``held_inside_bound`` says the
runtime holds inside and the run's output. Dijkstra over moves gives the least total cost to bring all
r samples to the output within the budget. Exponential: only for tiny instances (the
solver's tests, bench/oracle_miss.py).
"""

from __future__ import annotations

import heapq
import itertools
import math

from core.program import Step
from core.runs import held_inside_bound
from core.tree import Layer, Parallel, Profile, Series, fold_order, iter_layers, iter_nodes


ORT = "onnxruntime"


def _flatten(node):
    if isinstance(node, Series):
        return [u for child in node.children for u in _flatten(child)]
    return [node]


CALLS = (ORT, "cudagraph")  # the runtimes that run units in calls of runs


class _Runtimes:
    """What the profile says of the runtime that runs units in calls (ONNX Runtime, or CUDA
    graphs): which nodes it takes, their times inside a run, what a call costs (with the
    host's issue of it where measured: a call then costs the longer of the two), and whether
    torch may run a unit it takes (``--runtime onnxruntime`` keeps such units off torch)."""

    def __init__(self, profile: Profile):
        measured = (profile.meta.get("runtimes") or {})
        self.name = next((r for r in CALLS if (measured.get(r) or {}).get("call_s")), ORT)
        info = measured.get(self.name) or {}
        self.call_s, self.byte_s = info.get("call_s"), info.get("byte_s")
        self.host_s = info.get("host_s")
        self.named = any(layer.runtimes for layer in iter_layers(profile.root))
        # in play only where a unit measured it (a block alone runs no call of its own)
        if not any(dict(layer.runtimes).get(self.name) for layer in iter_layers(profile.root)):
            self.call_s = None
        self.only = profile.meta.get("runtime") == self.name

    def takes(self, node) -> bool:
        if any(name == self.name for name, _ in node.unsupported):
            return False
        if isinstance(node, Layer):
            return dict(node.runtimes).get(self.name) is not None
        return all(self.takes(c) for b in node.branches for c in b.children)

    def inside(self, node, c: int) -> float:
        measured = dict(node.runtimes).get(self.name)
        total = measured.time[c - 1] if measured is not None else (node.time[c - 1] if node.time else 0.0)
        if isinstance(node, Parallel):
            total += sum(self.inside(child, c) for b in node.branches for child in b.children)
        return total

    def call(self, c: int, in_bytes: int, out_bytes: int, inside: float) -> float:
        """A call of units costing ``inside`` in all."""
        if not self.call_s:
            return inside
        device = self.call_s[c - 1] + self.byte_s[c - 1] * (in_bytes + out_bytes) * c + inside
        return max(device, self.host_s[c - 1]) if self.host_s else device

    def torch(self, unit: Layer, c: int) -> tuple[float, int] | None:
        """(time, ws) of a unit's own step on torch (None where it may not run there)."""
        if not self.named:
            return unit.time[c - 1], unit.ws[c - 1]
        if self.only and self.takes(unit):
            return None
        measured = dict(unit.runtimes).get("torch")
        return (measured.time[c - 1], measured.ws[c - 1]) if measured is not None else \
            (unit.time[c - 1], unit.ws[c - 1])


def _series_of(node, owner=None, out=None):
    """Every node's series and position in it."""
    out = {} if out is None else out
    if isinstance(node, Series):
        for i, child in enumerate(node.children):
            out[child.name] = (id(node), i)
            _series_of(child, node, out)
    elif isinstance(node, Parallel):
        for branch in node.branches:
            _series_of(branch, node, out)
    return out


class _Chain:
    def __init__(self, node, is_branch: bool, rts: _Runtimes | None = None, where=None):
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
        self.branches = [[_Chain(b, True, rts, where) for b in u.branches]
                         if isinstance(u, Parallel) else None for u in self.units]
        self.rts = rts
        # the spans ONNX Runtime runs as one call: consecutive children of one series it takes
        self.spans = []
        if rts is not None and rts.named and rts.call_s is not None:
            for i, first in enumerate(self.units):
                for j in range(i, n):
                    node = self.units[j]
                    if where[node.name] != (where[first.name][0], where[first.name][1] + j - i) \
                            or not rts.takes(node):
                        break
                    self.spans.append((i, j))


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
        for i, j in chain.spans:
            if any(counts[i + 1:j + 1]):
                continue  # a run's units take what the one before made, nothing else
            nodes = chain.units[i:j + 1]
            for c in range(1, counts[i] + 1):
                need = held + held_inside_bound(nodes, c, chain.rts.name) + nodes[-1].out_bytes * c
                if need > budget:
                    continue
                new = list(counts)
                new[i] -= c
                new[j + 1] += c
                cost = chain.rts.call(c, nodes[0].in_bytes, nodes[-1].out_bytes,
                                      sum(chain.rts.inside(u, c) for u in nodes))
                yield cost, ("run", tuple(u.name for u in nodes), c), (tuple(new), None)
        for pos, unit in enumerate(chain.units):
            for c in range(1, counts[pos] + 1):
                if isinstance(unit, Layer):
                    own = chain.rts.torch(unit, c) if chain.rts is not None else \
                        (unit.time[c - 1], unit.ws[c - 1])
                    if own is None:
                        continue
                    need = held + own[1] + chain.run_out[pos] * c
                    if need > budget:
                        continue
                    new = list(counts)
                    new[pos] -= c
                    new[pos + 1] += c
                    cost = own[0] if objective == "time" else _cost(unit, c, objective)
                    yield cost, (unit.name, c), (tuple(new), None)
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
    """(least cost, moves) or (inf, None) when nothing fits; a move is (unit, c), or
    ("run", unit names, c) for one call of the runtime that runs units in calls."""
    rts = _Runtimes(profile)
    if objective != "time":
        rts.call_s = None  # the energy objective prices no calls: no runs
    root = _Chain(profile.root, False, rts, _series_of(profile.root))
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


# ------------------------------------------------------------------ instances, for checking


def chain_profile(layers: list[tuple[int, int, list[float], list[int]]], *, batch_max: int,
                  energy: list[list[float]] | None = None) -> Profile:
    """A hand-made chain: one (in, out, times, ws) per layer, named L0, L1, ..."""
    from core.tree import profile_from_json
    root = []
    for k, (i, o, t, w) in enumerate(layers):
        node = {"kind": "layer", "name": f"L{k}", "in": i, "out": o, "time": list(t), "ws": list(w)}
        if energy is not None:
            node["energy"] = list(energy[k])
        root.append(node)
    return profile_from_json({"schema": "vbs.profile/1", "batch_max": batch_max, "root": root})


def oracle_program(profile: Profile, moves) -> tuple[list[Step], list[tuple[int, int]]]:
    """The oracle's moves as a program's steps and runs (a run: every unit it holds, blocks
    whole, named for ONNX Runtime)."""
    nodes = {n.name: n for n in iter_nodes(profile.root)}
    rts = _Runtimes(profile)
    own = "torch" if rts.named else ""  # a unit's own step
    steps: list[Step] = []
    runs: list[tuple[int, int]] = []
    for move in moves:
        if move[0] != "run":
            steps.append(Step(move[0], move[1], own))
            continue
        start = len(steps)
        for name in move[1]:
            _whole(nodes[name], move[2], steps, rts.name)
        runs.append((start, len(steps) - 1))
    return steps, runs


def _whole(node, c: int, steps: list[Step], runtime: str) -> None:
    steps.append(Step(node.name, c, runtime))
    if isinstance(node, Parallel):
        for b in fold_order(node):
            for child in node.branches[b].children:
                _whole(child, c, steps, runtime)
