"""The division tree of a DAG (section 5 of the ACG paper), on plain integers.

The graph is given as vertices in topological order with their predecessors; a vertex is
an op together with the tensor it produces. ``decompose`` splits the independent segment
from ``source`` (exclusive: its tensor is the input) to ``sink`` (inclusive) into:

- a series of items at the *linear splitting vertices* (every path passes through them and
  no edge jumps over them: in a topological order, vertex at position p splits when every
  edge from an earlier position ends at or before p);
- between two consecutive splitters with vertices in between, a *branch* segment when the
  vertices strictly inside fall into weakly connected components that each reach the sink
  through exactly one vertex (their exit), plus an edge fork→sink for an identity branch,
  and the sink can fold its inputs one branch at a time (``join_kind`` says how);
- otherwise a *complicate* segment, kept whole as one opaque item (DenseNet's dense blocks).

Nothing here knows torch, so it is tested on hand-made DAGs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class DOp:
    """One vertex run on its own inside a series."""

    vertex: int


@dataclass(frozen=True)
class DSeries:
    """Items run one after the other; an empty series is an identity branch."""

    items: tuple["DItem", ...]


@dataclass(frozen=True)
class DParallel:
    """Branches from ``fork``'s tensor folded one at a time into the ``join`` vertex."""

    fork: int
    join: int
    join_kind: str
    branches: tuple[DSeries, ...]
    exits: tuple[int | None, ...]  # the vertex each branch ends with; None for identity


@dataclass(frozen=True)
class DOpaque:
    """A region that is neither series nor parallel, run as one unit."""

    source: int
    sink: int
    vertices: tuple[int, ...]  # in topological order, sink last


DItem = Union[DOp, DParallel, DOpaque]

# join_kind(fork, join, exits, has_identity) -> (kind, order) or None. kind is "cat", "add" or an
# op name; order lists the exits (None for the identity branch) in the order the sink reads
# them, so a cat writes its slices in order. None when the sink cannot be built one branch
# at a time: then the whole segment becomes opaque.
JoinKind = Callable[[int, int, Sequence[int], bool], "tuple[str, Sequence[int | None]] | None"]


def decompose(order: Sequence[int], preds: dict[int, Sequence[int]], source: int, sink: int,
              join_kind: JoinKind) -> DSeries:
    """The division tree of the segment ``source`` → ``sink`` whose vertices are ``order``.

    ``order`` lists the segment's vertices in topological order, without ``source`` and
    ending with ``sink``; every vertex's predecessors lie in the segment or are ``source``.
    """
    members = list(order)
    pos = {v: i + 1 for i, v in enumerate(members)}
    pos[source] = 0
    succs: dict[int, list[int]] = {v: [] for v in [source, *members]}
    for v in members:
        for p in preds[v]:
            if p in succs:
                succs[p].append(v)
    # Splitting positions: no edge from before p lands after p.
    cuts = [0]
    reach = max((pos[s] for s in succs[source]), default=0)
    for i, v in enumerate(members, start=1):
        if reach <= i:
            cuts.append(i)
        reach = max(reach, max((pos[s] for s in succs[v]), default=0))
    if cuts[-1] != len(members):  # the sink always closes the segment
        cuts.append(len(members))
    verts = [source, *members]
    items: list[DItem] = []
    for a, b in zip(cuts, cuts[1:]):
        if b == a + 1:
            items.append(DOp(verts[b]))
        else:
            items.append(_segment(verts[a], verts[b], verts[a + 1:b], preds, succs, join_kind))
    return DSeries(tuple(items))


def _segment(fork: int, join: int, inner: list[int], preds: dict[int, Sequence[int]],
             succs: dict[int, list[int]], join_kind: JoinKind) -> DItem:
    """A segment with no splitter inside: branches if it divides into them, else opaque."""
    inside = set(inner)
    parent = {v: v for v in inner}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for v in inner:
        for p in preds[v]:
            if p in inside:
                parent[find(p)] = find(v)
    groups: dict[int, list[int]] = {}
    for v in inner:  # keeps topological order inside each group
        groups.setdefault(find(v), []).append(v)
    identity = join in succs[fork]
    exits: list[int] = []
    branch_members: list[list[int]] = []
    for members in groups.values():
        outs = [v for v in members if join in succs[v]]
        leaks = [v for v in members if any(s not in inside and s != join for s in succs[v])]
        if len(outs) != 1 or leaks:
            return DOpaque(fork, join, tuple(inner) + (join,))
        exits.append(outs[0])
        branch_members.append(members)
    n_branches = len(branch_members) + (1 if identity else 0)
    verdict = join_kind(fork, join, exits, identity) if n_branches >= 2 else None
    if verdict is None:
        return DOpaque(fork, join, tuple(inner) + (join,))
    kind, order = verdict
    body_of = dict(zip(exits, branch_members))
    branches: list[DSeries] = []
    for exit_v in order:
        if exit_v is None:
            branches.append(DSeries(()))
        else:  # the exit is last in topological order: nothing else in the branch follows it
            branches.append(decompose(body_of[exit_v], preds, fork, exit_v, join_kind))
    return DParallel(fork, join, kind, tuple(branches), tuple(order))


def walk_vertices(item: DItem | DSeries) -> list[int]:
    """Every vertex an item owns (a parallel owns its join, not its fork)."""
    if isinstance(item, DOp):
        return [item.vertex]
    if isinstance(item, DSeries):
        return [v for it in item.items for v in walk_vertices(it)]
    if isinstance(item, DOpaque):
        return list(item.vertices)
    return [v for b in item.branches for v in walk_vertices(b)] + [item.join]
