"""Hypothesis strategies for tiny instances, checked against the exhaustive oracle
(``planner.solver.oracle``, which the solver's tests import from here with them)."""

from __future__ import annotations

from dataclasses import replace

from core.tree import Layer, Measured, Profile, Series, iter_layers
from planner.solver.oracle import ORT, chain_profile, oracle, oracle_program


def strategies():
    """Hypothesis strategies for tiny chains and trees: (profile, r, budget)."""
    from hypothesis import strategies as st

    from core.tree import profile_from_json

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

    @st.composite
    def with_onnxruntime(draw, base, runtime: str = ORT, host: bool = False):
        """A case of ``base`` whose units ``runtime`` (ONNX Runtime, or CUDA graphs) also
        measured (most of them: some it does not take), with a cost of a call (and, with
        ``host``, the host's issue of one, which a call costs where it is longer), and the
        runtime choice auto or that runtime."""
        profile, r, budget = draw(base)
        B = profile.batch_max

        def ints(lo, hi, n=B):
            return tuple(draw(st.integers(lo, hi)) for _ in range(n))

        def layer(node: Layer) -> Layer:
            torch = Measured(node.time, node.ws)
            if draw(st.integers(0, 4)) == 0:
                return replace(node, runtimes=(("torch", torch),), runtime=("torch",) * B,
                               unsupported=((runtime, "not exported"),))
            other = Measured(tuple(float(t) for t in ints(1, 9)), ints(0, 4))
            chosen = tuple(runtime if other.time[b] < torch.time[b] else "torch"
                           for b in range(B))
            pick = {runtime: other, "torch": torch}
            return replace(node, time=tuple(pick[c].time[b] for b, c in enumerate(chosen)),
                           ws=tuple(pick[c].ws[b] for b, c in enumerate(chosen)),
                           runtimes=(("torch", torch), (runtime, other)), runtime=chosen)

        def visit(node):
            if isinstance(node, Layer):
                return layer(node)
            if isinstance(node, Series):
                return replace(node, children=tuple(visit(c) for c in node.children))
            block = replace(node, branches=tuple(visit(b) for b in node.branches))
            runtimes = ((runtime, Measured(tuple(float(t) for t in ints(0, 2)))),) \
                if all(dict(u.runtimes).get(runtime) for u in iter_layers(block)) else ()
            return replace(block, runtimes=runtimes)

        info = {"version": "test", "call_s": [float(v) for v in ints(0, 6)],
                "byte_s": [draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(B)]}
        if host:
            info["host_s"] = [float(v) for v in ints(0, 16)]
        meta = {"runtime": draw(st.sampled_from(["auto", "auto", runtime])),
                "runtimes": {runtime: info}}
        return Profile(batch_max=B, root=visit(profile.root), meta=meta), r, budget + \
            draw(st.integers(0, 12))

    return small_chain, small_tree, with_onnxruntime


def _layers_of(nodes):
    for n in nodes:
        if n["kind"] == "layer":
            yield n
        elif n["kind"] == "parallel":
            for b in n["branches"]:
                yield from _layers_of(b["children"])


__all__ = ["chain_profile", "oracle", "oracle_program", "strategies"]
