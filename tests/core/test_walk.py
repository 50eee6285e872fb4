"""The executor's memory walk on hand-made trees: views, gathers, splits, folds, rounding,
per-step needs, errors."""

from __future__ import annotations

import pytest

from core.errors import InvalidProgramError
from core.program import Step
from core.tree import Layer, Parallel, Series
from core.walk import account, executor_peak, layout


def layer(name: str, size: int = 1, ws: int = 0, b: int = 4) -> Layer:
    return Layer(name, size, size, time=(1.0,) * b, ws=tuple(ws * k for k in range(1, b + 1)))


CHAIN = Series("net", (layer("L1", ws=1), layer("L2", ws=4), layer("L3", ws=1)))


def steps(*pairs: tuple[str, int]) -> list[Step]:
    return [Step(u, c) for u, c in pairs]


def test_uniform_batches_need_input_ws_and_output_only() -> None:
    # Batch 2 everywhere: the request is not counted; L2 holds its 2 inputs, 8 ws, 2 out.
    assert executor_peak(CHAIN, steps(("L1", 2), ("L2", 2), ("L3", 2)), 2) == 12


def test_a_view_keeps_its_chunk_until_the_last_sample_is_read() -> None:
    # The paper's example: L1 on 2, L2 on 1 twice, L3 on 2. The second L2 run still holds
    # L1's whole output (2), the first L2 output (1), its workspace (4) and output (1).
    program = steps(("L1", 2), ("L2", 1), ("L2", 1), ("L3", 2))
    assert executor_peak(CHAIN, program, 2) == 8


def test_splitting_a_chunk_frees_each_piece_after_its_reader() -> None:
    chain = Series("net", (layer("A", ws=0), layer("B", ws=4)))
    program = steps(("A", 2), ("B", 1), ("B", 1))
    # Unsplit, the second B still holds A's whole output: 2 + B's first output 1 + 4 + 1.
    assert executor_peak(chain, program, 2) == 8
    # Split into 1 + 1 right after A: each piece is freed when its B has run.
    assert executor_peak(chain, program, 2, splits={0: [1, 1]}) == 7
    chosen = layout(chain, program, 2)
    assert (chosen.splits, chosen.peak, chosen.peak_without_splits) == ({0: [1, 1]}, 7, 8)
    # Step needs: A (its output 2 and, for a moment, the two pieces copied from it), B on one
    # (both pieces, 4 ws, 1 out), B on the other (its piece, the first B's output, 4, 1).
    assert chosen.needs == (2 + 2, 2 + 4 + 1, 1 + 1 + 4 + 1)


def test_splits_that_do_not_lower_the_peak_are_not_made() -> None:
    # B's workspace dominates while A's whole output is still held either way.
    chain = Series("net", (layer("A", ws=0), layer("B", ws=40)))
    program = steps(("A", 2), ("B", 2))
    chosen = layout(chain, program, 2)
    assert chosen.splits == {} and chosen.peak == 2 + 80 + 2


def test_allocations_are_rounded_to_the_granule() -> None:
    # Sizes of 1 byte per sample on a 512-byte allocator: each buffer takes a whole block.
    program = steps(("L1", 2), ("L2", 2), ("L3", 2))
    assert executor_peak(CHAIN, program, 2, granule=512) == 512 + 8 + 512
    # Each step: what is held, its workspace (measured beyond its rounded output), its output.
    assert account(CHAIN, program, 2, granule=512).needs == [2 + 512, 512 + 8 + 512, 512 + 2 + 512]


def test_a_take_spread_over_chunks_is_gathered() -> None:
    # L1 one at a time, then L2 on both: the gather buffer (2) is allocated while the two
    # chunks (1 + 1) still exist, then they are freed before L2 runs.
    program = steps(("L1", 1), ("L1", 1), ("L2", 2), ("L3", 2))
    assert executor_peak(CHAIN, program, 2) == max(1 + 1 + 1, 1 + 1 + 2, 2 + 8 + 2, 2 + 2 + 2)


def test_parallel_block_folds_branch_outputs_into_its_join() -> None:
    tree = Series("net", (
        layer("stem", size=2),
        Parallel("blk", 2, 4, branches=(Series("a", (layer("a1", size=2, ws=1),)), Series("id", ())),
                 join="add"),
        Layer("head", 4, 1, time=(1.0,) * 4, ws=(0,) * 4),
    ))
    program = steps(("stem", 2), ("blk", 2), ("a1", 1), ("a1", 1), ("head", 2))
    # While a1 runs on one sample: fork 2x2 held, join 2x4, ws 1, its output 1x2.
    assert executor_peak(tree, program, 2) == 4 + 8 + 1 + 2


@pytest.mark.parametrize("program, message", [
    (steps(("L1", 2), ("L2", 3)), "fewer are waiting"),
    (steps(("L9", 1),), "unknown unit"),
    (steps(("L1", 2), ("L2", 2)), "every sample to the output"),
    (steps(("L1", 0),), "on 0 samples"),
])
def test_invalid_programs_are_refused(program, message) -> None:
    with pytest.raises(InvalidProgramError, match=message):
        executor_peak(CHAIN, program, 2)
