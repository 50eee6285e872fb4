"""Retry with exponential backoff and jitter, for callers of a store that may be down.

The HTTP service keeps serving its last table while Redis is away and reconnects in the
background; ``retry_async`` is that loop. The delays come from ``Backoff.delay``, a pure
function of the attempt number and a uniform random number, so they are tested exactly;
jitter spreads the reconnects of many workers so they do not hit a restarted Redis at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from planner.errors import StoreError, UsageError

T = TypeVar("T")
RetryHook = Callable[[int, BaseException, float], None]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``base * factor**attempt`` seconds, at most ``cap``, less jitter."""

    base: float = 0.1
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.5  # share of each delay that is random: 0 = none, 1 = "full jitter"

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.factor >= 1 and self.cap >= self.base
                and 0 <= self.jitter <= 1):
            raise UsageError(f"backoff {self}: need base > 0, factor >= 1, cap >= base and "
                             "0 <= jitter <= 1")

    def ceiling(self, attempt: int) -> float:
        """The delay before retry ``attempt`` (0-based) without jitter."""
        if attempt < 0:
            raise UsageError(f"attempt {attempt} must be >= 0")
        try:
            return min(self.cap, self.base * self.factor ** attempt)
        except OverflowError:
            return self.cap

    def delay(self, attempt: int, u: float) -> float:
        """The delay before retry ``attempt``, given ``u`` drawn uniformly from [0, 1).

        It lies in ``(ceiling * (1 - jitter), ceiling]``; ``u = 0`` gives the ceiling.
        """
        if not 0 <= u < 1:
            raise UsageError(f"u = {u} must lie in [0, 1)")
        return self.ceiling(attempt) * (1 - self.jitter * u)

    def delays(self, attempts: int | None = None,
               rng: random.Random | None = None) -> Iterator[float]:
        """Successive delays (endless when ``attempts`` is None), drawn with ``rng``."""
        rng = rng or random.Random()
        attempt = 0
        while attempts is None or attempt < attempts:
            yield self.delay(attempt, rng.random())
            attempt += 1


async def retry_async(operation: Callable[[], Awaitable[T]], *, backoff: Backoff = Backoff(),
                      attempts: int | None = None,
                      retry_on: tuple[type[BaseException], ...] = (StoreError,),
                      rng: random.Random | None = None,
                      sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                      on_retry: RetryHook | None = None) -> T:
    """Await ``operation()`` until it succeeds; retry on ``retry_on`` errors after a backoff delay.

    ``attempts`` counts every call, the first included (None: retry forever); when they are
    spent the last error is raised. ``on_retry(attempt, error, delay)`` is called before
    each wait (to log it).
    """
    delays = backoff.delays(rng=rng)
    attempt = 0
    while True:
        try:
            return await operation()
        except retry_on as exc:
            attempt += 1
            if attempts is not None and attempt >= attempts:
                raise
            wait = next(delays)
            if on_retry is not None:
                on_retry(attempt, exc, wait)
            await sleep(wait)


def retry(operation: Callable[[], T], *, backoff: Backoff = Backoff(), attempts: int | None = 5,
          retry_on: tuple[type[BaseException], ...] = (StoreError,),
          rng: random.Random | None = None, sleep: Callable[[float], object] = time.sleep,
          on_retry: RetryHook | None = None) -> T:
    """The synchronous twin of ``retry_async`` (for the CLI); five attempts by default."""
    delays = backoff.delays(rng=rng)
    attempt = 0
    while True:
        try:
            return operation()
        except retry_on as exc:
            attempt += 1
            if attempts is not None and attempt >= attempts:
                raise
            wait = next(delays)
            if on_retry is not None:
                on_retry(attempt, exc, wait)
            sleep(wait)
