"""One rule for shape text (core.shapes): flags, served models and request shapes alike."""

from __future__ import annotations

import pytest

from core.errors import UsageError
from core.shapes import MAX_RANK, parse_shape


@pytest.mark.parametrize("text, shape", [
    ("3,224,224", (3, 224, 224)), ("3x16x112x112", (3, 16, 112, 112)),
    (" 3, 8 ,8 ", (3, 8, 8)), ("[4,3,8,8]", (4, 3, 8, 8)), ("(2 3 4)", (2, 3, 4)), ("7", (7,)),
])
def test_shapes_read_by_one_rule(text: str, shape: tuple[int, ...]) -> None:
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["", "3,-1,4", "a,b", "0", "3,0,4", "3.5,2", "-1,3", "1," * 9 + "1"])
def test_bad_shapes_say_what_to_give(text: str) -> None:
    with pytest.raises(UsageError, match=r"input shape .*whole numbers >= 1"):
        parse_shape(text)


def test_a_batch_dimension_may_be_a_wildcard_only_where_asked_and_only_first() -> None:
    assert parse_shape("-1,3,8,8", batch=True) == (-1, 3, 8, 8)
    with pytest.raises(UsageError, match="^shape"):
        parse_shape("3,-1,8", batch=True, what="shape")
    with pytest.raises(UsageError):
        parse_shape("-1,3,8,8")


def test_rank_is_bounded() -> None:
    assert len(parse_shape(",".join(["1"] * MAX_RANK))) == MAX_RANK
    with pytest.raises(UsageError, match="at most 3"):
        parse_shape("1,1,1,1", max_rank=3)
