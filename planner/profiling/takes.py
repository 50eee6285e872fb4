"""What a runtime that runs units in calls takes of a tree, and its longest runs: one reading
for every such runtime (ONNX Runtime, CUDA graphs).

A block runs whole inside one call, so a runtime takes it only where it takes everything in
it; the longest runs are the stretches of the root series it takes, where the profiler times
units inside the calls the executor makes.
"""

from __future__ import annotations

from core.tree import Node, Parallel, Series, iter_nodes


def closed(tree: Series, unsupported: dict[str, str], why: str) -> dict[str, str]:
    """``unsupported`` with every block that holds a node in it (``why`` formats the reason
    from that node's name)."""
    out = dict(unsupported)
    for block in iter_nodes(tree):
        if isinstance(block, Parallel) and block.name not in out:
            inside = next((n.name for n in iter_nodes(block) if n is not block and n.name in out),
                          None)
            if inside is not None:
                out[block.name] = why.format(inside)
    return out


def longest_runs(tree: Series, unsupported: dict[str, str]) -> tuple[tuple[Node, ...], ...]:
    """The longest stretches of the root series whose every node (and all they hold) is
    taken."""
    def takes(node: Node) -> bool:
        return all(n.name not in unsupported for n in iter_nodes(node))

    runs: list[tuple[Node, ...]] = []
    current: list[Node] = []
    for node in tree.children:
        if takes(node):
            current.append(node)
        elif current:
            runs.append(tuple(current))
            current = []
    if current:
        runs.append(tuple(current))
    return tuple(runs)
