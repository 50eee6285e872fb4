"""Exponential backoff with jitter: the delays are a pure function, so they are checked exactly;
the retry loops are run with an injected sleep that records instead of waiting."""

from __future__ import annotations

import asyncio
import random

import pytest

from planner.errors import StoreError, UsageError
from planner.store.backoff import Backoff, retry, retry_async


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


class Flaky:
    """An operation that fails with StoreError a set number of times, then returns 'ok'."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreError(f"down (call {self.calls})")
        return "ok"


def test_retry_async_waits_the_backoff_delays_then_succeeds() -> None:
    backoff = Backoff(base=0.1, factor=2.0, cap=1.0, jitter=0.5)
    flaky, slept, hooked = Flaky(failures=3), [], []

    async def operation() -> str:
        return flaky()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    def on_retry(attempt: int, exc: BaseException, wait: float) -> None:
        hooked.append((attempt, str(exc), wait))

    result = asyncio.run(retry_async(operation, backoff=backoff, rng=random.Random(1), sleep=sleep,
                                     on_retry=on_retry))
    assert result == "ok" and flaky.calls == 4
    assert slept == list(backoff.delays(3, rng=random.Random(1)))
    assert [(n, msg) for n, msg, _ in hooked] == [(1, "down (call 1)"), (2, "down (call 2)"),
                                                  (3, "down (call 3)")]
    assert [wait for *_, wait in hooked] == slept


def test_retry_async_gives_up_after_its_attempts() -> None:
    flaky, slept = Flaky(failures=10), []

    async def operation() -> str:
        return flaky()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    with pytest.raises(StoreError, match="call 3"):
        asyncio.run(retry_async(operation, attempts=3, sleep=sleep))
    assert flaky.calls == 3 and len(slept) == 2


def test_retry_async_does_not_retry_other_errors() -> None:
    calls = []

    async def operation() -> None:
        calls.append(1)
        raise KeyError("bug")

    async def sleep(seconds: float) -> None:
        raise AssertionError("must not wait")

    with pytest.raises(KeyError):
        asyncio.run(retry_async(operation, sleep=sleep))
    assert calls == [1]


def test_retry_sync() -> None:
    flaky, slept = Flaky(failures=2), []
    assert retry(flaky, sleep=slept.append, rng=random.Random(3)) == "ok"
    assert slept == list(Backoff().delays(2, rng=random.Random(3)))
    with pytest.raises(StoreError, match="call 5"):
        retry(Flaky(failures=9), sleep=slept.append)
