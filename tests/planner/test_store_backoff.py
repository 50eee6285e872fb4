"""Exponential backoff with jitter: the delays are a pure function, so they are checked exactly."""

from __future__ import annotations

import random

import pytest

from core.errors import UsageError
from planner.store.backoff import Backoff


def test_ceiling_doubles_up_to_the_cap() -> None:
    backoff = Backoff(base=0.1, factor=2.0, cap=1.0, jitter=0.0)
    assert [backoff.ceiling(n) for n in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert [backoff.delay(n, 0.7) for n in range(6)] == [backoff.ceiling(n) for n in range(6)]


def test_huge_attempts_stay_at_the_cap() -> None:
    assert Backoff(base=1.0, factor=10.0, cap=30.0).ceiling(10_000) == 30.0


@pytest.mark.parametrize("u, expected", [(0.0, 0.8), (0.5, 0.6), (0.999, 0.4004)])
def test_jitter_takes_a_share_of_the_delay(u: float, expected: float) -> None:
    backoff = Backoff(base=0.1, factor=2.0, cap=10.0, jitter=0.5)
    assert backoff.delay(3, u) == pytest.approx(expected)


def test_full_jitter_spans_zero_to_the_ceiling() -> None:
    backoff = Backoff(base=1.0, factor=2.0, cap=8.0, jitter=1.0)
    assert backoff.delay(2, 0.0) == 4.0
    assert backoff.delay(2, 0.75) == pytest.approx(1.0)


def test_delays_are_reproducible_and_bounded() -> None:
    backoff = Backoff(base=0.05, factor=3.0, cap=2.0, jitter=0.3)
    first = list(backoff.delays(20, rng=random.Random(7)))
    assert first == list(backoff.delays(20, rng=random.Random(7)))
    assert len(first) == 20
    for n, delay in enumerate(first):
        assert backoff.ceiling(n) * 0.7 < delay <= backoff.ceiling(n)
    assert len(set(first[-5:])) == 5, "jitter spreads delays that reached the cap"


@pytest.mark.parametrize("kwargs", [{"base": 0}, {"factor": 0.5}, {"cap": 0.01},
                                    {"jitter": 1.5}, {"jitter": -0.1}])
def test_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(UsageError, match="backoff"):
        Backoff(**kwargs)


def test_bad_arguments() -> None:
    with pytest.raises(UsageError):
        Backoff().delay(0, 1.0)
    with pytest.raises(UsageError):
        Backoff().ceiling(-1)
