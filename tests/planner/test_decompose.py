"""The division tree on hand-made DAGs: series, branches, identity, nesting, opaque."""

from __future__ import annotations

from collections.abc import Sequence

from planner.graph.decompose import DOp, DOpaque, DParallel, DSeries, decompose, walk_vertices


def _tree(edges: list[tuple[int, int]], join_ok: bool = True) -> DSeries:
    n = 1 + max(max(e) for e in edges)
    preds: dict[int, list[int]] = {v: [] for v in range(n)}
    for a, b in edges:
        preds[b].append(a)

    def kind(fork: int, join: int, exits: Sequence[int], identity: bool):
        if not join_ok:
            return None
        return "cat", [*exits, *([None] if identity else [])]

    tree = decompose(list(range(1, n)), preds, 0, n - 1, kind)
    owned = walk_vertices(tree)
    assert sorted(owned) == list(range(1, n)), "every vertex belongs to exactly one item"
    return tree


def test_chain_is_a_series_of_ops() -> None:
    tree = _tree([(0, 1), (1, 2), (2, 3)])
    assert tree.items == (DOp(1), DOp(2), DOp(3))


def test_diamond_with_identity_is_a_parallel_block() -> None:
    # 0 -> 1 -> 2 -> 4, 1 -> 3 -> 4 and 1 -> 4: fork 1, join 4, three branches.
    tree = _tree([(0, 1), (1, 2), (2, 4), (1, 3), (3, 4), (1, 4), (4, 5)])
    assert tree.items[0] == DOp(1)
    block = tree.items[1]
    assert isinstance(block, DParallel)
    assert (block.fork, block.join) == (1, 4)
    assert [len(b.items) for b in block.branches] == [1, 1, 0]
    assert block.exits[-1] is None
    assert tree.items[2] == DOp(5)


def test_nested_blocks_inside_a_branch() -> None:
    # Outer fork 1 → {inner block 2→(3|4)→5, then 6} and identity → join 7.
    edges = [(0, 1), (1, 2), (2, 3), (2, 4), (3, 5), (4, 5), (5, 6), (6, 7), (1, 7)]
    tree = _tree(edges)
    outer = tree.items[1]
    assert isinstance(outer, DParallel) and outer.join == 7
    body = outer.branches[0].items
    assert body[0] == DOp(2)
    assert isinstance(body[1], DParallel) and (body[1].fork, body[1].join) == (2, 5)
    assert body[2] == DOp(6)


def test_dense_block_is_opaque() -> None:
    # DenseNet-like: every layer reads all earlier outputs; one component, many exits.
    edges = [(0, 1), (1, 2), (1, 3), (2, 3), (1, 4), (2, 4), (3, 4), (4, 5)]
    tree = _tree(edges)
    assert isinstance(tree.items[1], DOpaque)
    assert tree.items[1].vertices[-1] == 4


def test_a_join_that_cannot_fold_makes_the_segment_opaque() -> None:
    tree = _tree([(0, 1), (1, 2), (1, 3), (2, 4), (3, 4)], join_ok=False)
    assert isinstance(tree.items[1], DOpaque)


def test_edge_jumping_over_a_vertex_prevents_a_split() -> None:
    # 1 -> 2 -> 3 and 1 -> 3: vertex 2 is not a splitting vertex.
    tree = _tree([(0, 1), (1, 2), (2, 3), (1, 3), (3, 4)])
    assert isinstance(tree.items[1], DParallel)
    assert tree.items[1].fork == 1 and tree.items[1].join == 3
