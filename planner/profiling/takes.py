"""What a runtime that runs units in calls takes of a tree, and its longest runs: one reading
for every such runtime (ONNX Runtime, CUDA graphs).

A block runs whole inside one call, so a runtime takes it only where it takes everything in
it; the longest runs are the stretches of the root series it takes, where the profiler times
units inside the calls the executor makes.
"""

from __future__ import annotations

from core.tree import Node, Parallel, Series, iter_nodes


# how a reason a unit or block is refused for its layout begins (``planner.profiling.ort``:
# its input or output is not dense in the model): ONNX Runtime computes it right, and it is
# refused only beside torch; ``planner.profiling.profiler.chosen_again`` lifts it for the
# tables of the worker without torch (``ProfileOptions.lean``)
LAYOUT = "layout: "


def for_layout(why: str) -> bool:
    """Whether a refusal is for the layout alone (the node was measured all the same)."""
    return why.startswith(LAYOUT)


def lifted(unsupported: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A node's refusals without those of its layout."""
    return tuple((rt, why) for rt, why in unsupported if not for_layout(why))


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
